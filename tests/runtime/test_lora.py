"""Multi-LoRA serving against transformers + peft: random adapters peft itself builds and saves,
greedy tokens through the engine for each family, rows with different adapters in one batch,
the prefix cache kept apart by adapter, slots swapped without compiling, and bad adapter files
refused with the problem named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.store import convert
from runtime.config import LoraConfig
from runtime.core.lora import AdapterBusy, AdapterError
from runtime.model.runner import compilations
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine
from tests.runtime.test_families_config import PROMPT, build_hf

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")
torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[peer])")
peft = pytest.importorskip("peft", reason="peft not installed (pip install -e .[test])")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N = 10
SP = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


def build_adapter(src: Path, out: Path, seed: int, r: int = 8, alpha: float = 16, targets=ALL, rslora: bool = False,
                  scale: float = 0.5, **kw) -> Path:
    """A peft LoRA on the transformers model in `src` with random A and B (large enough to change
    the greedy tokens), saved in PEFT's format."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    lc = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, **kw)
    pm = peft.get_peft_model(model, lc)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn_like(p) / p.shape[1] ** 0.5)
    pm.save_pretrained(out)
    return out


def peft_greedy(src: Path, adapter: Path | None, prompt: list[int], n: int = N) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(eng, jobs: list[tuple[list[int], str | None]], sp: SamplingParams = SP) -> list[list[int]]:
    reqs = [eng.add_request(p, sp, lora=name) for p, name in jobs]
    eng.run_until_done()
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_llama")
    src = build_hf(tmp / "hf", "llama")
    convert(HFSource(src), tmp / "ck", progress=False)
    adapters = [build_adapter(src, tmp / "a0", 1),
                build_adapter(src, tmp / "a1", 2, r=4, alpha=8, targets=["q_proj", "v_proj"], rslora=True),
                build_adapter(src, tmp / "a2", 3, r=16, alpha=32, targets=["o_proj", "down_proj"])]
    return src, tmp / "ck", adapters


OTHER = [int(t) for t in np.random.default_rng(11).integers(3, 200, 40)]


def test_llama_adapters_match_peft_alone_and_mixed_in_one_batch(llama):
    src, ck, adapters = llama
    eng = make_engine(ck, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      lora=LoraConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4))
    for i, a in enumerate(adapters):
        eng.load_lora(f"a{i}", str(a))
    want = {name: peft_greedy(src, None if name is None else adapters[int(name[1])], PROMPT)
            for name in (None, "a0", "a1", "a2")}
    assert len({tuple(v) for v in want.values()}) == 4  # each adapter changes the answer
    alone = {name: run(eng, [(PROMPT, name)])[0] for name in want}
    assert alone == want
    # four rows, three adapters and the base, two device slots: they queue for slots and still match
    mixed = run(eng, [(PROMPT, "a0"), (PROMPT, None), (PROMPT, "a1"), (PROMPT, "a2")])
    assert mixed == [want["a0"], want[None], want["a1"], want["a2"]]
    other = run(eng, [(OTHER, "a0"), (PROMPT, "a0"), (OTHER, None)])
    assert other[1] == want["a0"]
    assert other[0] == peft_greedy(src, adapters[0], OTHER) and other[2] == peft_greedy(src, None, OTHER)
    snap = eng.loras.snapshot()
    assert {a["name"]: a["requests"] for a in snap["adapters"]} == {"a0": 4, "a1": 2, "a2": 2}
    # the ledger of a request that waited for a slot says so, then where its adapter went
    kinds = [(d.kind, d.reason) for r in eng._finished_ledgers.values() for d in r[1].entries]
    assert any(k == "waiting" and "LoRA slot" in why for k, why in kinds)
    assert any(k == "lora" and "written into device slot" in why for k, why in kinds)
    assert any(k == "lora" and "already in device slot" in why for k, why in kinds)
    assert snap["swaps_in"] >= 3


def test_prefix_cache_is_kept_apart_by_adapter(llama):
    """The same prompt under another adapter (or none) hits nothing of the first's blocks, and
    gets its own answer; the same adapter again hits them."""
    src, ck, adapters = llama
    eng = make_engine(ck, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      lora=LoraConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=4))
    eng.load_lora("a0", str(adapters[0]))
    eng.load_lora("a1", str(adapters[1]))
    first = eng.generate([PROMPT], SP, lora="a0")[0]
    base = eng.generate([PROMPT], SP)[0]
    other = eng.generate([PROMPT], SP, lora="a1")[0]
    again = eng.generate([PROMPT], SP, lora="a0")[0]
    assert base.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens >= 64 and again.output_ids == first.output_ids
    assert base.output_ids == peft_greedy(src, None, PROMPT)
    assert other.output_ids == peft_greedy(src, adapters[1], PROMPT)
    # reloaded under the same name: a new load is a new adapter, its prefixes new too
    eng.unload_lora("a0")
    eng.load_lora("a0", str(adapters[2]))
    swapped = eng.generate([PROMPT], SP, lora="a0")[0]
    assert swapped.num_cached_tokens == 0 and swapped.output_ids == peft_greedy(src, adapters[2], PROMPT)


def test_adding_and_removing_adapters_compiles_nothing_after_warmup(llama, tmp_path):
    src, ck, adapters = llama
    eng = make_engine(ck, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, warmup=True,
                      lora=LoraConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2))
    before = compilations(), compilations("_write")
    for round_ in range(2):
        for i, a in enumerate(adapters):
            eng.load_lora(f"x{i}", str(a))
        run(eng, [(PROMPT, "x0"), (OTHER, "x1"), (PROMPT, "x2"), (OTHER, None)])
        for i in range(3):
            eng.unload_lora(f"x{i}")
    assert (compilations(), compilations("_write")) == before
    assert eng.loras.swaps_in >= 6


def w4a16_as_float(src: Path, out: Path) -> Path:
    """The transformers model with every weight w4a16 quantizes replaced by its dequantized values
    (4-bit projections, the 8-bit grouped head): the float model the w4a16 engine computes."""
    from runtime.model.quant import dequantize_int4, quantize_weight_grouped, quantize_weight_int4

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = p.detach().numpy().T.copy()  # [in, out]
            if name.endswith("proj.weight"):
                w = dequantize_int4(quantize_weight_int4(w))
            elif name == "lm_head.weight":
                g = quantize_weight_grouped(w)
                K, V = g["q"].shape
                w = (g["q"].reshape(K // 32, 32, V).astype(np.float32) * g["g"][:, None, :]).reshape(K, V)
            else:
                continue
            p.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
    model.save_pretrained(out)
    return out


def test_quantized_bases_under_lora(llama, tmp_path):
    """w4a16 (weight-only: exact) gives transformers + peft's tokens on the dequantized base; w8a8
    (SmoothQuant folded into the norms, which the adapter's A follows; activations quantized)
    keeps the float model's answer under the adapter for its first 8 tokens; both differ from
    their base model's."""
    src, ck, adapters = llama
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for q, want in (("w4a16", peft_greedy(w4a16_as_float(src, tmp_path / "deq"), adapters[0], PROMPT, 16)),
                    ("w8a8", peft_greedy(src, adapters[0], PROMPT, 16))):
        eng = make_engine(ck, num_blocks=96, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                          quantization=q, lora=LoraConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1))
        eng.load_lora("a0", str(adapters[0]))
        got = eng.generate([PROMPT], sp, lora="a0")[0].output_ids
        base = eng.generate([PROMPT], sp)[0].output_ids
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        assert same >= (16 if q == "w4a16" else 8), (q, got, want)
        assert got[:4] != base[:4]


def test_bad_adapters_are_refused_naming_the_problem(llama, tmp_path):
    src, ck, adapters = llama
    eng = make_engine(ck, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                      lora=LoraConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1))
    with pytest.raises(AdapterError, match="rank 16 .* exceeds --max-lora-rank 8"):
        eng.load_lora("big", str(adapters[2]))
    with pytest.raises(AdapterError, match="not a directory"):
        eng.load_lora("none", str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.mkdir()
    conf = json.loads((adapters[0] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**conf, "modules_to_save": ["lm_head"]}))
    (bad / "adapter_model.safetensors").write_bytes((adapters[0] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="modules_to_save"):
        eng.load_lora("bad", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        eng.load_lora("bad", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="cannot be read"):
        eng.load_lora("bad", str(bad))
    assert eng.loras.snapshot()["adapters"] == []  # nothing half-loaded
    with pytest.raises(LookupError, match="no adapter named 'ghost'"):
        eng.add_request(PROMPT, SP, lora="ghost")
    eng.load_lora("a0", str(adapters[0]))
    with pytest.raises(AdapterError, match="already loaded"):
        eng.load_lora("a0", str(adapters[0]))
    req = eng.add_request(PROMPT, SP, lora="a0")
    with pytest.raises(AdapterBusy, match="1 request"):
        eng.unload_lora("a0")
    eng.run_until_done()
    assert req.output_ids == peft_greedy(src, adapters[0], PROMPT)
    eng.unload_lora("a0")


def _family(arch: str, out: Path) -> tuple[Path, list[str]]:
    """A tiny transformers checkpoint of `arch` and the modules an adapter on it targets."""
    if arch in ("gemma2", "gemma3"):
        from tests.runtime.test_families_gemma import build_gemma
        return build_gemma(out, arch), ALL
    if arch == "phi3":
        from tests.runtime.test_families_phi3 import build_phi3
        return build_phi3(out), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    if arch == "mixtral":
        return build_hf(out, arch, num_local_experts=4, num_experts_per_tok=2), ["q_proj", "k_proj", "v_proj", "o_proj"]
    return build_hf(out, arch), ALL


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral"])
def test_every_family_matches_peft_alone_and_beside_the_base(arch, tmp_path):
    """Each family with an adapter peft builds on it: its tokens alone, and in one batch beside
    the base model's rows (which keep the base tokens)."""
    src, targets = _family(arch, tmp_path / "hf")
    convert(HFSource(src), tmp_path / "ck", progress=False)
    ad = build_adapter(src, tmp_path / "ad", 4, targets=targets)
    want, base = peft_greedy(src, ad, PROMPT), peft_greedy(src, None, PROMPT)
    assert want != base
    eng = make_engine(tmp_path / "ck", num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      lora=LoraConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1))
    eng.load_lora("ad", str(ad))
    assert run(eng, [(PROMPT, "ad")]) == [want]
    assert run(eng, [(PROMPT, None), (PROMPT, "ad"), (PROMPT, None)]) == [base, want, base]


def test_expert_targets_are_refused(tmp_path):
    src = build_hf(tmp_path / "hf", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    convert(HFSource(src), tmp_path / "ck", progress=False)
    ad = build_adapter(src, tmp_path / "ad", 4, targets=["q_proj"])
    from safetensors.numpy import load_file, save_file

    tensors = load_file(ad / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"
    save_file({**tensors, key: np.zeros((8, 64), np.float32)}, ad / "adapter_model.safetensors")
    eng = make_engine(tmp_path / "ck", num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                      lora=LoraConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1))
    with pytest.raises(AdapterError, match="experts.0.gate_proj.lora_A.weight is not a LoRA weight"):
        eng.load_lora("ad", str(ad))


@pytest.mark.parametrize("variant", ["plain", "lora_grouped_yarn"])
def test_deepseek_latent_attention_adapters_match_peft(variant, tmp_path):
    """DeepSeek-V2 (multi-head latent attention, with and without a low-rank query): adapters on
    its query, latent kv_a and output projections give peft's tokens; kv_b_proj (absorbed into
    the attention) is refused naming it."""
    from tests.runtime.test_families_deepseek import DEEPSEEK, VARIANTS

    src = build_hf(tmp_path / "hf", "deepseek_v2", **{**DEEPSEEK, **VARIANTS[variant]})
    convert(HFSource(src), tmp_path / "ck", progress=False)
    q = ["q_a_proj", "q_b_proj"] if variant != "plain" else ["q_proj"]
    ad = build_adapter(src, tmp_path / "ad", 6, targets=[*q, "kv_a_proj_with_mqa", "o_proj"])
    want, base = peft_greedy(src, ad, PROMPT), peft_greedy(src, None, PROMPT)
    assert want != base
    eng = make_engine(tmp_path / "ck", num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      lora=LoraConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1))
    eng.load_lora("ad", str(ad))
    assert run(eng, [(PROMPT, None), (PROMPT, "ad")]) == [base, want]
    kvb = build_adapter(src, tmp_path / "kvb", 6, targets=["kv_b_proj"])
    with pytest.raises(AdapterError, match="kv_b_proj is not supported"):
        eng.load_lora("kvb", str(kvb))


@pytest.mark.parametrize("kernels,dtype", [(False, "float32"), (True, "bfloat16"), (False, "bfloat16")],
                         ids=["xla", "kernel-bf16", "xla-bf16"])
def test_xla_path_and_bfloat16_slots_give_the_kernels_tokens(llama, kernels, dtype):
    """The XLA products (sorted segments; no C++ kernels) and bfloat16 slots: the mixed batch's
    tokens equal peft's (the tiny model's answers are decisive enough for bfloat16's rounding)."""
    from runtime.config import KernelConfig

    src, ck, adapters = llama
    eng = make_engine(ck, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      kernels=KernelConfig(cpu_kernels=kernels),
                      lora=LoraConfig(max_loras=3, max_lora_rank=16, max_cpu_loras=4, dtype=dtype))
    assert eng.runner.params["lora"].kernel == kernels
    for i, a in enumerate(adapters):
        eng.load_lora(f"a{i}", str(a))
    got = run(eng, [(PROMPT, "a0"), (PROMPT, None), (PROMPT, "a1"), (PROMPT, "a2")])
    assert got == [peft_greedy(src, adapters[0], PROMPT), peft_greedy(src, None, PROMPT),
                   peft_greedy(src, adapters[1], PROMPT), peft_greedy(src, adapters[2], PROMPT)]


def test_lora_kernel_matches_its_reference():
    """The C++ products (parts, -1 rows, ranks, float32 and bfloat16 tables) against numpy."""
    import jax.numpy as jnp

    from runtime.kernels.cpu.build import available
    from runtime.kernels.cpu.lora import lora_products

    if not available():
        pytest.skip("the C++ CPU kernels are not built here")
    rng = np.random.default_rng(0)
    L, S, K, R, parts = 3, 4, 40, 5, (0, 24, 32, 40)
    P, N = len(parts) - 1, parts[-1]
    a = rng.standard_normal((L, S, K, P * R)).astype(np.float32)
    b = rng.standard_normal((L, S, R, N)).astype(np.float32)
    x = rng.standard_normal((13, K)).astype(np.float32)
    slots = rng.integers(-1, S, 13).astype(np.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        aa, bb = np.asarray(jnp.asarray(a, dtype), np.float32), np.asarray(jnp.asarray(b, dtype), np.float32)
        got = np.asarray(lora_products(jnp.asarray(x), jnp.asarray(slots), jnp.asarray(a, dtype), jnp.asarray(b, dtype),
                                       parts, 2))
        want = np.zeros((13, N), np.float32)
        for t, s in enumerate(slots):
            if s >= 0:
                u = x[t] @ aa[2, s]
                for p in range(P):
                    want[t, parts[p]:parts[p + 1]] = u[p * R:(p + 1) * R] @ bb[2, s][:, parts[p]:parts[p + 1]]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_kv_events_carry_the_adapters_lora_id(llama):
    """vLLM's BlockStored.lora_id: the id of the adapter's load for its blocks, none for the base's."""
    from runtime.core.kv_events import BlockStored, to_vllm_events

    src, ck, adapters = llama
    eng = make_engine(ck, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      lora=LoraConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1))
    reg = eng.load_lora("a0", str(adapters[0]))
    eng.pool.record_events()
    eng.generate([PROMPT], SP, lora="a0")
    eng.generate([OTHER], SP)
    stored = [e for e in to_vllm_events(eng.pool.take_events(), 16) if isinstance(e, BlockStored)]
    assert {e.lora_id for e in stored} == {reg.lora_id, None} and reg.lora_id > 0
    assert sum(len(e.block_hashes) for e in stored if e.lora_id == reg.lora_id) == (len(PROMPT) + N - 1) // 16


def test_console_model_page_loads_and_unloads_adapters_audited(llama):
    """The model page's LoRA card: slots, adapters with their requests and tokens, a load form and
    an unload button (both audited; a bad path refused with the reason, nothing loaded)."""
    from tests.console.admin_util import console_client, logged_in

    src, ck, adapters = llama
    eng = make_engine(ck, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                      lora=LoraConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2))
    with console_client(eng) as client:
        csrf = logged_in(client)
        hx = {"HX-Request": "true", "X-CSRF-Token": csrf}
        r = client.post("/admin/model/lora", data={"name": "t1", "path": str(adapters[0])}, headers=hx)
        assert r.status_code == 200 and "Loaded adapter t1." in r.text and "<code>t1</code>" in r.text
        r = client.post("/admin/model/lora", data={"name": "t2", "path": "/nowhere"}, headers=hx)
        assert r.status_code == 422 and "Nothing was loaded" in r.text and "not a directory" in r.text
        eng.generate([PROMPT], SP, lora="t1")
        page = client.get("/admin/model").text
        assert 'id="lora-adapters"' in page and 'id="lora-t1"' in page
        row = page[page.index('id="lora-t1"'):].split("</tr>")[0]
        assert f">{N}<" in row and ">1<" in row  # tokens and requests
        r = client.post("/admin/model/lora/unload", data={"name": "t1"}, headers=hx)
        assert r.status_code == 200 and "Unloaded adapter t1." in r.text and "No adapters loaded." in r.text
        rows = [(a.who, a.action, a.detail.get("name")) for a in client.app.state.store.iter_audit()
                if a.action.endswith("_lora")]
        assert rows == [("admin", "load_lora", "t1"), ("admin", "unload_lora", "t1")]


def test_lora_flags_parse_and_refuse_in_one_line(tmp_path):
    from runtime.core.engine_args import lora_config_from_args, lora_modules
    from tests.runtime.test_families_config import engine_args

    args = engine_args("--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                       "--max-loras", "2", "--lora-dtype", "bfloat16")
    assert lora_modules(args) == [("a", "/x"), ("b", "/y")]
    assert lora_config_from_args(args) == LoraConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=32, dtype="bfloat16")
    assert lora_config_from_args(engine_args()) is None
    with pytest.raises(ValueError, match="max_loras: needs --enable-lora"):
        lora_config_from_args(engine_args("--max-loras", "8"))
    with pytest.raises(ValueError, match="must be name=path"):
        lora_config_from_args(engine_args("--lora-modules", "nopath"))
    with pytest.raises(ValueError, match="given twice"):
        lora_config_from_args(engine_args("--lora-modules", "a=/x", "a=/y"))
    with pytest.raises(ValueError, match="lora_modules: extra not supported"):
        lora_config_from_args(engine_args("--lora-modules", '{"name": "a", "path": "/x", "extra": 1}'))
    with pytest.raises(ValueError, match="lora_modules: base_model_name not supported"):  # (not checked: refused)
        lora_config_from_args(engine_args("--lora-modules", '{"name": "a", "path": "/x", "base_model_name": "m"}'))
    with pytest.raises(ValueError, match="max_cpu_loras: must be at least max_loras"):
        lora_config_from_args(engine_args("--enable-lora", "--max-loras", "8", "--max-cpu-loras", "4"))


def test_the_benchmarks_adapters_are_valid_peft_adapters(tmp_path):
    """scripts/bench_lora.py writes its random adapters in PEFT's format: the reader takes them."""
    import sys

    from runtime.core.lora import read_adapter
    from tests.tiny import tiny_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from bench_lora import write_adapter

    cfg = tiny_config(300)
    ad = read_adapter(write_adapter(tmp_path / "a", cfg, 8, 0), cfg, 16, ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                                           "w_down"))
    assert ad.rank == 8 and set(ad.modules) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    assert ad.weights["wq"][0].shape == (cfg.num_layers, cfg.hidden_size, 8)
