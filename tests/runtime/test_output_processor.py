"""The output processor: token outputs -> text, stop strings, callbacks; inline and on its
own thread (runtime/core/output_processor.py)."""

import threading

import pytest
from tokenizers import Tokenizer

from runtime.core.async_engine import AsyncEngine
from runtime.core.engine import RequestOutput
from runtime.core.output_processor import OutputProcessor
from runtime.model.sampling import SamplingParams
from runtime.tokenizer import IncrementalDetokenizer, TextTokenizer
from tests.engine_util import make_engine
from tests.tiny import tiny_tokenizer_json


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer(Tokenizer.from_str(tiny_tokenizer_json()[0]), eos_token_ids=(0,))


def ids_of(tok, text):
    return tok.encode(text)


def feed(proc, rid, ids, *, last=None):
    """One token output per id, the engine's way (completion_tokens counts them); `last`:
    finish kwargs for the final one."""
    outs = []
    for n, t in enumerate(ids, 1):
        kw = dict(last or {}) if n == len(ids) and last else {}
        outs += proc.push([RequestOutput(rid, [t], "", completion_tokens=n, **kw)])
    return outs


def test_text_is_the_decoded_tokens_and_an_eos_adds_none(tok):
    got = []
    proc = OutputProcessor(tok, on_stop=lambda *a: pytest.fail("no stop string here"))
    proc.add("r", [5, 6], SamplingParams(), got.append)
    ids = ids_of(tok, "the cat sat on the mat")
    outs = feed(proc, "r", ids + [0], last=dict(finished=True, finish_reason="stop", text_ids=[]))
    assert "".join(o.text for o in outs) == "the cat sat on the mat"
    assert got == outs and outs[-1].finished and outs[-1].token_ids == [0]
    assert all(o.text_ids is None for o in outs)  # the processor's outputs carry text, not text_ids


def test_a_stop_string_ends_the_request_here_and_the_engine_s_rest_is_dropped(tok):
    stops, got = [], []
    proc = OutputProcessor(tok, on_stop=lambda rid, s: stops.append((rid, s)))
    proc.add("r", [5], SamplingParams(stop=("sat",)), got.append)
    ids = ids_of(tok, "the cat sat on")
    n_stop = next(n for n in range(1, len(ids) + 1) if "sat" in tok.decode(ids[:n]))
    outs = feed(proc, "r", ids[:n_stop])
    assert stops == [("r", "sat")]
    assert "".join(o.text for o in outs) == "the cat "
    end = outs[-1]
    assert end.finished and end.finish_reason == "stop" and end.stop_reason == "sat"
    assert end.completion_tokens == n_stop
    # the engine had launched one more step, then ends the request at its boundary
    assert proc.push([RequestOutput("r", [ids[n_stop]], "", completion_tokens=n_stop + 1)]) == []
    assert proc.push([RequestOutput("r", [], "", finished=True, finish_reason="stop", stop_reason="sat")]) == []
    assert got == outs and not proc._live and not proc._stopped


def test_the_tail_that_could_begin_a_stop_string_is_held_back_until_the_end(tok):
    proc = OutputProcessor(tok, on_stop=lambda *a: pytest.fail("'cab' never appears"))
    proc.add("r", [5], SamplingParams(stop=("cab",)), None)
    outs = feed(proc, "r", ids_of(tok, "xca"))
    assert "".join(o.text for o in outs) == "x"  # "ca" may still become "cab": len("cab") - 1 held
    outs += proc.push([RequestOutput("r", ids_of(tok, "t"), "", completion_tokens=4)])
    assert "".join(o.text for o in outs) == "xc"
    outs += proc.push([RequestOutput("r", [], "", completion_tokens=4, finished=True, finish_reason="abort")])
    assert "".join(o.text for o in outs) == "xcat"  # an end lets the held text go


def test_a_character_split_across_tokens_comes_out_whole(tok):
    """Byte-level tokens of one UTF-8 character: nothing until its last byte, never U+FFFD."""
    proc = OutputProcessor(tok, on_stop=lambda *a: pytest.fail("no stop string here"))
    proc.add("r", ids_of(tok, "say"), SamplingParams(), None)
    text = "a 🦀 é日"
    ids = ids_of(tok, text)
    assert len(ids) > len(text)  # the crab is 4 byte tokens, é 2, 日 3
    deltas = [o.text for o in feed(proc, "r", ids)]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert "🦀" in deltas and deltas.count("") == len(ids) - len([d for d in deltas if d])


def test_special_tokens_are_skipped_unless_asked_for(tok):
    im_end = ids_of(tok, "<|im_end|>")
    assert len(im_end) == 1
    ids = ids_of(tok, "ab") + im_end + ids_of(tok, " cd")
    for skip, want in ((True, "ab cd"), (False, "ab<|im_end|> cd")):
        d = IncrementalDetokenizer(tok, ids_of(tok, "x"), skip_special_tokens=skip)
        assert "".join(d.push([t]) for t in ids) == d.text == want


def test_a_prompt_ending_inside_a_character_is_not_echoed(tok):
    """Token-id prompts may end mid-character: the context the detokenizer keeps is never output."""
    prompt = ids_of(tok, "hi 🦀")[:-1]
    assert tok.decode(prompt).endswith("\ufffd")
    d = tok.detokenizer(prompt)
    assert "".join(d.push([t]) for t in ids_of(tok, " ok")) == " ok"


def test_min_tokens_and_a_stop_string_on_the_length_token(tok):
    stops, ends = [], []
    proc = OutputProcessor(tok, on_stop=lambda rid, s: stops.append(s), on_end=lambda rid, r: ends.append((rid, r)))
    ids = ids_of(tok, "ab ab")
    proc.add("early", [5], SamplingParams(stop=("ab",), min_tokens=len(ids)), None)
    # "ab" appears before min_tokens: not searched; at min_tokens the second one is found
    outs = feed(proc, "early", ids)
    assert [o.finished for o in outs] == [False] * (len(ids) - 1) + [True]
    assert outs[-1].stop_reason == "ab" and stops == ["ab"]
    ids = ids_of(tok, "xy ab")
    proc.add("len", [5], SamplingParams(stop=("ab",)), None)
    outs = feed(proc, "len", ids, last=dict(finished=True, finish_reason="length"))
    assert [o.finished for o in outs] == [False] * (len(ids) - 1) + [True]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "ab"
    assert stops == ["ab"]  # the engine had ended that one already: nothing to tell it
    assert "".join(o.text for o in outs) == "xy "
    proc.add("plain", [5], SamplingParams(stop=("zz",)), None)
    feed(proc, "plain", ids, last=dict(finished=True, finish_reason="length"))
    # the client-visible end of each length-ended request with stop strings, once
    assert ends == [("len", "stop"), ("plain", "length")]


def test_threaded_mode_delivers_everything_off_the_pushing_thread(tok):
    seen = []
    proc = OutputProcessor(tok, on_stop=lambda *a: None)
    text = "the cat sat on the mat " * 20
    ids = ids_of(tok, text)
    for r in range(8):
        proc.add(f"r{r}", [5], SamplingParams(), lambda o: seen.append((o, threading.current_thread().name)))
    proc.start()
    for n, t in enumerate(ids, 1):
        last = n == len(ids)
        assert proc.push([RequestOutput(f"r{r}", [t], "", completion_tokens=n, finished=last,
                                        finish_reason="length" if last else None) for r in range(8)]) == []
    proc.stop()  # drains the queue
    assert proc.idle and not proc.threaded and not proc._live
    assert {name for _, name in seen} == {"pagedjax-outputs"}
    for r in range(8):
        assert "".join(o.text for o, _ in seen if o.request_id == f"r{r}") == text


def test_served_stop_strings_match_inline_ones_with_the_processor_on_its_thread(tiny_ckpt):
    """The same requests through LLMEngine.step() inline and through AsyncEngine (output
    thread): same text, same finish, and every block back."""
    eng = make_engine(tiny_ckpt)
    p = [10, 20, 30, 40]
    full = []
    eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), on_output=full.append)
    eng.run_until_done()
    text = "".join(o.text for o in full)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=(text[i:i + 2],))
              for i in (1, 4, 7)]
    inline = {}
    for i, sp in enumerate(params):
        eng.add_request(p, sp, request_id=f"in{i}", on_output=lambda o, i=i: inline.setdefault(i, []).append(o))
    eng.run_until_done()

    ae = AsyncEngine(eng)
    ae.start()
    threaded, done = {}, threading.Event()
    names = set()

    def cb(o, i):
        names.add(threading.current_thread().name)
        threaded.setdefault(i, []).append(o)
        if len([1 for v in threaded.values() if v[-1].finished]) == len(params):
            done.set()

    try:
        for i, sp in enumerate(params):
            eng.add_request(p, sp, request_id=f"th{i}", on_output=lambda o, i=i: cb(o, i))
        ae._wake.set()
        assert done.wait(60)
    finally:
        ae.stop(grace_s=5)
    assert names == {"pagedjax-outputs"}
    for i, sp in enumerate(params):
        a, b = inline[i], threaded[i]
        assert "".join(o.text for o in a) == "".join(o.text for o in b) == text[:text.index(sp.stop[0])]
        assert (a[-1].finish_reason, a[-1].stop_reason, a[-1].completion_tokens) == \
               (b[-1].finish_reason, b[-1].stop_reason, b[-1].completion_tokens) == ("stop", sp.stop[0],
                                                                                     a[-1].completion_tokens)
    assert not eng.has_unfinished() and eng.pool.num_used_blocks == 0
    assert eng.metrics.request_success.labels("stop")._value.get() >= 2 * len(params)


def test_logprobs_arrive_raw_and_leave_formatted(tok):
    """The engine hands over the step's raw rows (numpy); clients get plain Python pairs, a
    structured output's forbidden (-inf) tokens left out of the top list."""
    import numpy as np

    proc = OutputProcessor(tok, on_stop=lambda *a: pytest.fail("no stop string here"))
    proc.add("r", [5, 6, 7], SamplingParams(logprobs=3, prompt_logprobs=2), None)
    raw = [(np.float32(-0.5), np.array([4, 9, 2], np.int32), np.array([-0.5, -1.25, -np.inf], np.float32))]
    plp = [None, (np.float32(-2.0), np.array([3, 8], np.int32), np.array([-0.75, -3.0], np.float32)),
           (np.float32(-1.5), np.array([1, 2], np.int32), np.array([-1.5, -2.5], np.float32))]
    (out,) = proc.push([RequestOutput("r", [4], "", completion_tokens=1, logprobs=raw, prompt_logprobs=plp)])
    assert out.logprobs == [(-0.5, [(4, -0.5), (9, -1.25)])]
    assert out.prompt_logprobs == [None, (-2.0, [(3, -0.75), (8, -3.0)]), (-1.5, [(1, -1.5), (2, -2.5)])]
    lp, top = out.logprobs[0]
    assert type(lp) is float and all(type(a) is int and type(b) is float for a, b in top)


def test_metrics_count_the_end_the_client_saw(tiny_ckpt):
    """A stop string on the max_tokens token: the client sees "stop", and so do the metrics
    (request_success), inline and with the processor on its own thread."""
    eng = make_engine(tiny_ckpt)
    p = [10, 20, 30, 40]
    full = []
    eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), on_output=full.append)
    eng.run_until_done()
    last = "".join(o.text for o in full)  # the whole text: complete only with the 8th token
    assert last and full[-1].text

    def counts():
        return {r: eng.metrics.request_success.labels(r)._value.get() for r in ("stop", "length")}

    before = counts()
    got = []
    eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=(last,)),
                    on_output=got.append)
    eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=("\x00never",)))
    eng.run_until_done()
    assert got[-1].finish_reason == "stop" and got[-1].stop_reason == last
    after = counts()
    assert (after["stop"] - before["stop"], after["length"] - before["length"]) == (1, 1)
    assert not eng._uncounted


def test_tokens_pushed_several_at_a_time_give_the_text_of_one_at_a_time(tok):
    """A speculative step hands several tokens over at once: the detokenized text must not
    depend on how the tokens were grouped (a DecodeStream step over several ids lost the
    tail of their text)."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompt = tok.encode("one two three four")
    for _ in range(50):
        ids = [int(t) for t in rng.integers(3, 260, size=30)]
        one = tok.detokenizer(prompt)
        for t in ids:
            one.push([t])
        grouped = tok.detokenizer(prompt)
        i = 0
        while i < len(ids):
            k = int(rng.integers(1, 6))
            grouped.push(ids[i:i + k])
            i += k
        assert grouped.text == one.text and one.text
