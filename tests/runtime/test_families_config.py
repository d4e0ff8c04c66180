"""Model families' config.json against transformers: RoPE scaling (llama3, linear) in both
config styles, Mistral's and Qwen2's sliding window, and the rule that every config field
is implemented or refused in one line naming it (issue #37: a Llama 3.x config converted
without a word and generated different tokens from transformers).

The parity tests build tiny random checkpoints with transformers itself (save_pretrained),
convert them with pagedjax and compare greedy tokens and logprobs through the engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.checkpoint.gguf_source import GGUFSource
from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.store import convert, load_checkpoint, load_config
from runtime.cli import main
from runtime.config import ModelConfig, RopeScaling
from runtime.model.families.llama import dense_logits, init_params, rope_inv_freq
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine
from tests.model_files import write_gguf
from tests.tiny import tiny_config, tiny_tokenizer_json

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")
torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[peer])")

TOK_JSON, VOCAB = tiny_tokenizer_json()
# Small enough to build and compile in seconds; head_dim 32 is not hidden/heads (the explicit
# head_dim path) and with rope_theta 500000 and original_max_position_embeddings 32 llama3's
# three frequency bands are all present (kept, smoothed, slowed).
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5,
             tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, VOCAB, 80)]  # past position 32


def build_hf(out: Path, arch: str = "llama", seed: int = 0, **kw) -> Path:
    """A transformers model with random weights scaled like tests/tiny.py's (decisive greedy
    choices, no near-ties), saved as a Hugging Face directory with our tiny tokenizer."""
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)}[arch]
    sizes = dict(SIZES)
    if arch == "qwen2":
        sizes.pop("head_dim")  # Qwen2Config derives it
    config = cls[0](**{**sizes, **kw})
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(4 * torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(TOK_JSON)
    return out


def hf_reference(src: Path, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation and the log-softmax of every position's logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist() if n else []
        logits = model(torch.tensor([prompt + gen])).logits[0].double()
    return gen, torch.log_softmax(logits, -1).numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def assert_engine_matches(ckpt: Path, src: Path, prompt: list[int], n: int, max_model_len: int = 128) -> None:
    gen, logp = hf_reference(src, prompt, n)
    eng = make_engine(ckpt, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=max_model_len)
    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    r = eng.generate([prompt], sp)[0]
    assert r.output_ids == gen
    ids = prompt + gen
    mine = [lp for lp, _ in r.formatted_logprobs()]
    theirs = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(gen)]
    np.testing.assert_allclose(mine, theirs, atol=1e-3)
    mine_p = [lp for lp, _ in r.formatted_prompt_logprobs()]  # tokens 1.. of the prompt
    theirs_p = [logp[i - 1, ids[i]] for i in range(1, len(prompt))]
    np.testing.assert_allclose(mine_p, theirs_p, atol=1e-3)


def assert_prefix_cache_and_preemption_match(src: Path, ckpt: Path) -> None:
    """A second prompt sharing the first's 64 leading tokens reuses their blocks; four
    requests of 90-120 tokens in a pool of 16 blocks force a preemption; every request still
    gives transformers' tokens, alone or batched."""
    rng = np.random.default_rng(3)
    prompts = [PROMPT, PROMPT[:64] + [int(t) for t in rng.integers(3, 200, 12)],
               [int(t) for t in rng.integers(3, 200, 50)], [int(t) for t in rng.integers(3, 200, 70)]]
    want = [hf_reference(src, p, 40)[0] for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eng = make_engine(ckpt, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    first = eng.generate([prompts[0]], sp)[0]
    second = eng.generate([prompts[1]], sp)[0]
    assert second.num_cached_tokens >= 48  # whole 16-token blocks of the shared 64
    assert [first.output_ids, second.output_ids] == want[:2]
    tight = make_engine(ckpt, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                        watermark=0.0)
    got = tight.generate(prompts, sp)
    assert tight.scheduler.counters.preemptions > 0
    assert [r.output_ids for r in got] == want


# --- RoPE scaling: greedy tokens and logprobs equal transformers' ---------------------------

@pytest.mark.parametrize("rope", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_rope_scaling_matches_transformers(tmp_path, rope):
    src = build_hf(tmp_path / "hf", rope_parameters=dict(rope))
    hf_cfg = json.loads((src / "config.json").read_text())
    assert hf_cfg["rope_parameters"]["rope_type"] == rope["rope_type"] and "rope_scaling" not in hf_cfg  # 5.x style
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, params, _ = load_checkpoint(tmp_path / "ck")
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type == rope["rope_type"]
    # the scaling changes the outputs (else the parity below would prove nothing)
    ids = jnp.asarray(PROMPT)
    plain = dataclasses.replace(cfg, rope_scaling=None)
    assert np.abs(np.asarray(dense_logits(cfg, params, ids)) - np.asarray(dense_logits(plain, params, ids))).max() > 0.1
    assert_engine_matches(tmp_path / "ck", src, PROMPT, 16)


def test_transformers_4_style_rope_scaling_and_rope_theta(tmp_path):
    """The same model with the 4.x keys (rope_scaling + top-level rope_theta) converts to
    the same config as with 5.x's rope_parameters."""
    src = build_hf(tmp_path / "hf", rope_parameters=dict(LLAMA3))
    new = HFSource(src).model_config()
    c = json.loads((src / "config.json").read_text())
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp
    (src / "config.json").write_text(json.dumps(c))
    assert HFSource(src).model_config() == new
    c["rope_scaling"] = {"type": "linear", "factor": 4.0}  # the older "type" key
    (src / "config.json").write_text(json.dumps(c))
    cfg = HFSource(src).model_config()
    assert cfg.rope_scaling == RopeScaling(4.0, rope_type="linear") and cfg.rope_theta == 500000.0


def test_rope_parameters_per_layer_type_with_one_rope_for_every_layer(tmp_path):
    src = config_dir(tmp_path, "llama", rope_parameters={"full_attention": dict(LINEAR)})
    assert HFSource(src).model_config().rope_scaling == RopeScaling(4.0, rope_type="linear")


# --- every field that is not implemented is refused in one line naming it -----------------

def config_dir(tmp_path: Path, arch: str = "llama", **changes) -> Path:
    """config.json as transformers 5.x writes it for `arch` (tiny sizes), plus what a
    directory needs to open; no weights are read before the config is checked."""
    cls, name = {"llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
                 "mistral": (transformers.MistralConfig, "MistralForCausalLM"),
                 "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM")}[arch]
    sizes = {k: v for k, v in SIZES.items() if not (arch == "qwen2" and k == "head_dim")}
    c = cls(architectures=[name], **sizes).to_dict()
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    d = tmp_path / f"{arch}-hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(c))
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text(TOK_JSON)
    return d


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_transformers_default_configs_convert(tmp_path, arch):
    cfg = HFSource(config_dir(tmp_path, arch)).model_config()
    assert cfg.architecture == ("qwen2" if arch == "qwen2" else "llama")
    assert cfg.attention_bias == (arch == "qwen2")  # Qwen2Attention: q/k/v biases always
    assert cfg.sliding_window == (4096 if arch == "mistral" else None)  # MistralConfig's default window


MROPE = {"rope_type": "mrope", "factor": 4.0, "rope_theta": 1e4}  # (Qwen2-VL's: not implemented)
REFUSED = [
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("llama", {"mlp_bias": True}, "mlp_bias True"),
    ("llama", {"attention_bias": True}, "attention_bias True"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("llama", {"rope_interleaved": True}, "rope_interleaved True"),
    ("llama", {"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    ("llama", {"logit_scale": 2.0}, "'logit_scale'"),
    ("llama", {"sliding_window": 64}, "sliding_window 64"),
    ("llama", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types 'sliding_attention'"),
    ("llama", {"rope_parameters": MROPE}, "rope_parameters.rope_type 'mrope' is not supported"),
    ("llama", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "mrope", "factor": 4.0}},
     "rope_scaling.type 'mrope'"),
    ("llama", {"rope_parameters": {**LINEAR, "attention_factor": 2.0}}, "rope_parameters.attention_factor 2.0"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor 0.5"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters.factor is missing"),
    ("llama", {"rope_parameters": {**LLAMA3, "low_freq_factor": None}}, "rope_parameters.low_freq_factor"),
    ("llama", {"rope_parameters": {**LINEAR, "beta_fast": 32}}, "rope_parameters.beta_fast"),
    ("llama", {"rope_parameters": {"full_attention": LINEAR, "sliding_attention": LLAMA3}}, "rope_parameters per layer"),
    ("mistral", {"mlp_bias": True}, "'mlp_bias'"),
    ("mistral", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    ("mistral", {"sliding_window": 0}, "sliding_window 0"),
    ("mistral", {"rope_parameters": MROPE}, "rope_parameters.rope_type 'mrope'"),
    ("qwen2", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types 'chunked_attention'"),
    ("qwen2", {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 2}, "use_sliding_window"),
    ("qwen2", {"attention_bias": False}, "attention_bias False"),
    ("qwen2", {"rope_parameters": MROPE}, "rope_parameters.rope_type 'mrope'"),
]


@pytest.mark.parametrize("arch,changes,named", REFUSED, ids=[f"{a}-{n}" for a, _, n in REFUSED])
def test_unsupported_config_field_is_one_line_refusal_naming_it(tmp_path, capsys, arch, changes, named):
    src = config_dir(tmp_path, arch, **changes)
    with pytest.raises(CheckpointError, match="config.json: ") as exc:
        HFSource(src).model_config()
    assert named in str(exc.value) and "\n" not in str(exc.value)
    code = main(["convert", "--from", "hf", str(src), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and named in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_refused_rope_type_at_load_too(tmp_path):
    """A pagedjax config.json edited (or written by a newer version) to a rope type this one
    does not implement is refused at load as at convert."""
    from tests.tiny import make_tiny_checkpoint

    ck = make_tiny_checkpoint(tmp_path / "ck")
    c = json.loads((ck / "config.json").read_text())
    c["rope_scaling"] = {"rope_type": "mrope", "factor": 4.0}
    (ck / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=r"config.json: invalid \(rope_scaling.rope_type: 'mrope' is not supported"):
        load_config(ck)
    c["rope_scaling"] = {"rope_type": "linear", "factor": 2.0, "mscale": 1.0}
    (ck / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=r"rope_scaling: unknown fields \['mscale'\]"):
        load_config(ck)


def test_old_config_without_rope_type_loads_as_llama3(tmp_path):
    """Checkpoints converted before rope_type existed stored llama3 scaling without it."""
    tok_json, vocab = tiny_tokenizer_json()
    old = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    d = tiny_config(vocab, rope_theta=500000.0).to_json()
    d["rope_scaling"] = old
    del d["sliding_window"]  # nor did they have this
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = ModelConfig.load(tmp_path / "config.json")
    assert cfg.rope_scaling == RopeScaling(**old, rope_type="llama3") and cfg.sliding_window is None
    cfg.save(tmp_path / "new.json")  # written back with its rope_type, read back equal
    assert json.loads((tmp_path / "new.json").read_text())["rope_scaling"] == {"rope_type": "llama3", **old}
    assert ModelConfig.load(tmp_path / "new.json") == cfg
    linear = dataclasses.replace(cfg, rope_scaling=RopeScaling(4.0, rope_type="linear"))
    # (rope_inv_freq: [inverse frequencies, amplitudes])
    np.testing.assert_allclose(rope_inv_freq(linear)[0],
                               rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))[0] / 4, rtol=1e-6)
    assert not np.allclose(rope_inv_freq(cfg)[0], rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))[0])


# --- sliding window: masked per layer, so prompts run past it ------------------------------

def engine_args(*argv: str) -> argparse.Namespace:
    from runtime.core.engine_args import add_engine_arguments

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(list(argv))


def test_mistral_sliding_window(tmp_path):
    """A 24-token window and an 80-token prompt plus 20 decoded: every layer's keys slide
    out of the window (whole blocks too), and the tokens and logprobs are transformers'."""
    src = build_hf(tmp_path / "hf", "mistral", sliding_window=24, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 10000.0})
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, params, _ = load_checkpoint(tmp_path / "ck")
    assert cfg.sliding_window == 24 and cfg.layer_windows() == (24, 24)
    from runtime.core.engine_args import engine_config_from_args

    # the context is no longer capped at the window
    assert engine_config_from_args(engine_args())(cfg).scheduler.max_model_len == 1024
    assert engine_config_from_args(engine_args("--max-model-len", "128"))(cfg).scheduler.max_model_len == 128
    ids = jnp.asarray(PROMPT)  # the window changes the outputs past it (else the parity proves nothing)
    full = dataclasses.replace(cfg, sliding_window=None)
    assert np.abs(np.asarray(dense_logits(cfg, params, ids)) - np.asarray(dense_logits(full, params, ids))).max() > 0.1
    assert_engine_matches(tmp_path / "ck", src, PROMPT, 20)


def test_qwen2_sliding_window_matches_transformers(tmp_path):
    """Qwen2 with use_sliding_window from layer 1 on: layer 0 full, layer 1 windowed."""
    src = build_hf(tmp_path / "hf", "qwen2", use_sliding_window=True, sliding_window=24, max_window_layers=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg = load_config(tmp_path / "ck")
    assert cfg.layer_windows() == (0, 24)
    assert_engine_matches(tmp_path / "ck", src, PROMPT, 20)


@pytest.mark.parametrize("changes,window", [
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "layer_types": None}, 64),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2, "layer_types": None}, None),
    ({"use_sliding_window": False, "sliding_window": 64, "layer_types": None}, None),
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]}, 64),
])
def test_qwen2_sliding_window(tmp_path, changes, window):
    """Qwen2 slides only with use_sliding_window, on layers from max_window_layers on (or
    where layer_types says so)."""
    assert HFSource(config_dir(tmp_path, "qwen2", **changes)).model_config().sliding_window == window


# --- GGUF: llama.cpp's RoPE metadata and rope_freqs.weight -------------------------------

@pytest.fixture
def gguf_extra(monkeypatch):
    """write_gguf, with extra metadata / tensors added just before its header is written."""
    import gguf

    extra: dict = {"kv": {}, "tensors": {}}

    class Writer(gguf.GGUFWriter):
        def write_header_to_file(self, *a, **kw):
            for name, arr in extra["tensors"].items():
                self.add_tensor(name, arr)
            for key, (kind, value) in extra["kv"].items():
                getattr(self, f"add_{kind}")(key, value)
            return super().write_header_to_file(*a, **kw)

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    return extra


def llama_cpp_rope_factors(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs.weight for a llama3 rope_scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, np.float32)


def test_gguf_rope_freqs_are_llama3_scaling(tmp_path, gguf_extra):
    """llama.cpp stores Llama 3.x's scaling as per-frequency divisors; the GGUF converts to
    the same logits as the Hugging Face checkpoint, and both equal transformers'."""
    src = build_hf(tmp_path / "hf", rope_parameters=dict(LLAMA3), tie_word_embeddings=True)  # write_gguf: tied
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, params, _ = load_checkpoint(tmp_path / "ck")
    gguf_extra["tensors"]["rope_freqs.weight"] = llama_cpp_rope_factors(32, 500000.0, LLAMA3)
    g = write_gguf(tmp_path / "m.gguf", dataclasses.replace(cfg, rope_scaling=None),
                   {k: np.asarray(v) if not isinstance(v, dict) else {n: np.asarray(a) for n, a in v.items()}
                    for k, v in params.items()}, TOK_JSON)
    convert(GGUFSource(g), tmp_path / "ck2", progress=False)
    cfg2, params2, _ = load_checkpoint(tmp_path / "ck2")
    assert cfg2.rope_scaling.rope_type == "freq_factors"
    ids = jnp.asarray(PROMPT)
    got = np.asarray(dense_logits(cfg2, params2, ids))
    np.testing.assert_allclose(got, np.asarray(dense_logits(cfg, params, ids)), atol=1e-4)
    _, logp = hf_reference(src, PROMPT, 0)
    np.testing.assert_allclose(log_softmax(got), logp, atol=1e-3)


@pytest.mark.parametrize("kv,named", [
    ({"llama.rope.scaling.type": ("string", "yarn")}, "llama.rope.scaling.type 'yarn'"),
    ({"llama.rope.scaling.attn_factor": ("float32", 0.5)}, "llama.rope.scaling.attn_factor"),
    ({"llama.attention.scale": ("float32", 0.5)}, "'llama.attention.scale'"),
    ({"llama.expert_count": ("uint32", 8)}, "llama.expert_count 8"),
])
def test_gguf_unsupported_metadata_is_refused(tmp_path, gguf_extra, kv, named):
    cfg = tiny_config(VOCAB)
    gguf_extra["kv"].update(kv)
    g = write_gguf(tmp_path / "m.gguf", cfg, init_params(cfg, 1), TOK_JSON)
    with pytest.raises(CheckpointError) as exc:
        GGUFSource(g).model_config()
    assert named in str(exc.value) and "\n" not in str(exc.value)


def test_gguf_linear_scaling(tmp_path, gguf_extra):
    cfg = tiny_config(VOCAB)
    gguf_extra["kv"].update({"llama.rope.scaling.type": ("string", "linear"),
                             "llama.rope.scaling.factor": ("float32", 4.0)})
    g = write_gguf(tmp_path / "m.gguf", cfg, init_params(cfg, 1), TOK_JSON)
    assert GGUFSource(g).model_config().rope_scaling == RopeScaling(4.0, rope_type="linear")
