"""model/fastdecode.py (eval_dflash --method fast) against the HF decode loop it stands in for: its greedy equals
greedy_decode token for token (tiny Llama and Qwen3, SmolLM2 when present), its speculative loop equals
speculative_decode in tokens and in tokens committed per step (random drafters, sliding layers, a briefly trained
drafter that accepts often; eos and max_new_tokens cutting a block), and the CLI's result; its re-wired pieces equal
what they stand in for bit for bit (RoPE, the drafter's step and context K/V), and its steps launch the kernels
tools/count_ops.py says they do. CPU, fp32, eager: the CUDA-graph path replays these same step functions
(tests/gpu/test_fastdecode_cuda.py checks it on a GPU)."""
import importlib
import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import SMOLLM2_DIR, TINY
from fastdecode_cases import B, MAX_NEW, load, random_prompts, trained  # noqa: F401 (a fixture)
from model.engine import SUPPORTED
from data.prompts import encode_prompt
from eval_dflash import main
from model.decode import DrafterProposer, eos_ids, greedy_decode, speculative_decode
from model.drafter import DrafterCache, _apply_rope, rope_cos_sin
from model.export import export_drafter
from model.fastdecode import DraftState, FastDecoder, additive_mask, attend, rope, rotated_sin
from tools import count_ops


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    """A tiny random Qwen3 with 8 tokens: a random drafter then guesses right now and then."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("fast_vocab8")
    Qwen3ForCausalLM(Qwen3Config(**{**TINY, "vocab_size": 8}, tie_word_embeddings=False)).save_pretrained(path)
    return path, load(path)


def same_as_decode(model, drafter, prompts, max_new=MAX_NEW, eos=frozenset(), attention="sdpa"):
    """Runs both loops on every prompt, asserts tokens and steps equal -> the steps."""
    fast = FastDecoder(model, max(map(len, prompts)) + max_new + B - 1, attention=attention)
    proposer, state = DrafterProposer(drafter, model), fast.drafter(drafter, B)
    steps = []
    for p in prompts:
        want = speculative_decode(model, p, proposer, B, max_new, eos)
        got = fast.speculative(p, state, max_new, eos)
        assert got == want, (p, got, want)
        steps.append(want["steps"])
    return steps


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("qwen3", "sdpa"), ("qwen3", "matmul")])
def test_fast_greedy_equals_greedy_decode(family, attention, tiny_llama_dir, tiny_qwen3_dir):
    model = load({"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}[family])
    prompts = random_prompts(128)
    fast = FastDecoder(model, 30 + 24, attention=attention)
    free = [greedy_decode(model, p, 24, set()) for p in prompts]
    i = next(i for i in range(3, 24) if free[3][i] not in free[3][:i])
    eos = {free[3][i]}                                         # stops prompt 3 after i + 1 tokens
    for p, want_free in zip(prompts, free):
        assert fast.greedy(p, 24, set()) == want_free
        assert fast.greedy(p, 24, eos) == greedy_decode(model, p, 24, eos)
    assert fast.greedy(prompts[3], 24, eos) == free[3][:i + 1]
    assert fast.greedy(prompts[3], 1, set()) == free[3][:1]    # done after the prefill


def test_fast_greedy_equals_greedy_decode_on_smollm2():
    if not (SMOLLM2_DIR / "model.safetensors").exists():
        pytest.skip(f"no SmolLM2 folder at {SMOLLM2_DIR}: build it with `.venv/bin/python -m tools.smollm2`")
    from transformers import AutoTokenizer
    model, tok = load(SMOLLM2_DIR), AutoTokenizer.from_pretrained(SMOLLM2_DIR, local_files_only=True)
    eos = eos_ids(model, tok)
    prompts = [encode_prompt(tok, {"prompt": q}) for q in ("What is AI?", "Name three colors.")]
    fast = FastDecoder(model, max(map(len, prompts)) + 12)
    for p in prompts:
        assert fast.greedy(p, 12, eos) == greedy_decode(model, p, 12, eos)


@pytest.mark.parametrize("sliding,attention", [(0, "sdpa"), (1, "sdpa"), (1, "matmul")])
def test_fast_speculative_equals_decode_with_random_drafters(vocab8, build_drafter, sliding, attention):
    path, model = vocab8
    prompts = random_prompts(8, (3, 11, 26), seed=2)
    steps = []
    for seed in (0, 1):
        d = build_drafter(path, num_layers=2, block_size=B, seed=seed, sliding_window_layers=sliding,
                          sliding_window=6 if sliding else None).eval()
        steps += same_as_decode(model, d, prompts, attention=attention)
    assert max(s for row in steps for s in row) > 1             # some drafts accepted


def test_fast_speculative_equals_decode_on_llama(tiny_llama_dir, build_drafter):
    same_as_decode(load(tiny_llama_dir), build_drafter(tiny_llama_dir, num_layers=1, block_size=B).eval(),
                   random_prompts(128))


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_fast_speculative_equals_decode_with_a_trained_drafter(trained, attention):
    model, drafter, prompts = trained
    steps = same_as_decode(model, drafter, prompts + random_prompts(128, (9, 17), seed=3), attention=attention)
    assert set(s for row in steps for s in row) == set(range(1, B + 1))   # every accepted length occurs


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_matmul_attention_equals_sdpa(dtype, tol):
    """attend(how="matmul") against SDPA on the masks the two loops build: the target's [kv heads' folded queries,
    keys] causal over a cache with unwritten rows past the block, and the drafter's one row of visible keys; with
    the target's scale and with SDPA's default. Equal up to rounding (bf16: the scores round to bf16 first)."""
    g = torch.Generator().manual_seed(0)
    kv, group, n, L, D = 2, 3, 4, 24, 16
    q = torch.randn(1, kv, group * n, D, generator=g).to(dtype)
    k, v = (torch.randn(1, kv, L, D, generator=g).to(dtype) for _ in range(2))
    zero, neg_inf = torch.tensor(0.0, dtype=dtype), torch.tensor(-torch.inf, dtype=dtype)
    pos, keys = torch.arange(10, 10 + n), torch.arange(L)
    causal = additive_mask((keys[None] <= pos[:, None]).repeat(group, 1), zero, neg_inf)          # [group*n, L]
    context = additive_mask(keys < 7, zero, neg_inf)[None]                                     # [1, L]
    for mask, scale in ((causal, 0.3), (context, None)):
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=scale)
        got = attend(q, k, v, mask, scale, "matmul")
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
        assert attend(q, k, v, mask, scale, "sdpa").equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                          scale=scale))
    # keys the mask hides do not count: changing them changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 7:], v2[:, :, 7:] = 100, -100
    assert attend(q, k2, v2, context, None, "matmul").equal(attend(q, k, v, context, None, "matmul"))
    with pytest.raises(ValueError, match="attention='flash': one of sdpa, matmul"):
        FastDecoder(None, 8, attention="flash")                 # refused before the model is read


def test_attention_output_in_the_cuda_kernels_layout(trained, monkeypatch):
    """CUDA's flash and efficient SDPA kernels return [1, heads, n, D] as a transposed [1, n, heads, D] buffer, not
    the contiguous tensor the CPU's math kernel returns; the loop must not assume either (a .view there failed on the
    H200). Same values, that layout: the loop still equals the decode loop."""
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa(*a, **k).transpose(1, 2).contiguous().transpose(1, 2))
    model, drafter, prompts = trained
    same_as_decode(model, drafter, prompts)


def test_eos_and_max_new_tokens_cut_a_block(trained):
    model, drafter, prompts = trained
    p = prompts[1]
    free = same_as_decode(model, drafter, [p])[0]
    new = speculative_decode(model, p, DrafterProposer(drafter, model), B, MAX_NEW, set())["tokens"]
    starts = [1 + sum(free[:i]) for i in range(len(free))]     # index in `new` of each step's first token
    # a step of >= 2 tokens whose first token is new so far: as eos it ends that step after one token
    i = next(i for i, (s, n) in enumerate(zip(starts, free)) if n >= 2 and new[s] not in new[:s])
    cut = same_as_decode(model, drafter, [p], eos={new[starts[i]]})[0]
    assert cut == free[:i] + [1]
    j = next(j for j, n in enumerate(free) if n >= 3)
    cut = same_as_decode(model, drafter, [p], max_new=starts[j] + 2)[0]
    assert cut == free[:j] + [2]


def test_too_small_a_cache_is_refused(trained):
    model, drafter, prompts = trained
    fast = FastDecoder(model, 40)
    with pytest.raises(ValueError, match=r"a prompt of 26 tokens \+ 12 new tokens \+ block size 4 - 1 needs 41"):
        fast.speculative(prompts[2], fast.drafter(drafter, B), 12, set())
    assert len(fast.greedy(prompts[2], 12, set())) == 12          # greedy writes no block past the last token


def test_cli_fast(tiny_qwen3_dir, trained, tmp_path, capsys):
    """--method fast writes tau, speedup and what it was measured on; its tau and steps equal --method decode's."""
    model, drafter, prompts = trained
    export_drafter(drafter, tmp_path / "d")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n"
                                              for i, p in enumerate(prompts)))
    args = ["--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "d"), "--prompts", str(tmp_path / "p.jsonl"),
            "--device", "cpu", "--max-new-tokens", "24", "--limit", "3"]
    fast = main(args + ["--method", "fast", "--out", str(tmp_path / "fast.json")])
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "fast.json").read_text()) == json.loads(json.dumps(fast))
    assert fast["measured_on"] == {"device": "cpu", "device_name": f"cpu ({torch.get_num_threads()} threads)",
                                   "dtype": "float32", "drafter_dtype": "float32", "method": "fast",
                                   "cuda_graphs": False, "attention": "sdpa"}
    assert fast["speedup"] == fast["tokens_per_s"]["dflash"] / fast["tokens_per_s"]["greedy"] > 0
    assert fast["lossless"] and fast["prompts"] == 3 and fast["tau"] > 1
    assert "(cpu, target float32, drafter float32, fast loop, eager, sdpa attention): greedy" in out
    decode = main(args)
    assert decode["tau"] == fast["tau"] and decode["accept_hist"] == fast["accept_hist"]
    matmul = main(args + ["--method", "fast", "--attention", "matmul"])
    assert matmul["measured_on"]["attention"] == "matmul" and matmul["lossless"]
    assert matmul["tau"] == fast["tau"] and matmul["accept_hist"] == fast["accept_hist"]
    assert "fast loop, eager, matmul attention): greedy" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--attention matmul with --method decode: it picks the fast loop's"):
        main(args + ["--attention", "matmul"])
    assert [r["steps"] for r in decode["per_prompt"]] == [r["steps"] for r in fast["per_prompt"]]
    with pytest.raises(SystemExit, match="the fast loop verifies blocks only"):
        main(args + ["--method", "fast", "--tree-budget", "4"])


def test_bf16_drafter_with_an_fp32_target_stays_lossless(tiny_qwen3_dir, trained, tmp_path, capsys):
    """--drafter-dtype bfloat16 --dtype float32: the drafter proposes in bf16 (its weights, context cache and
    activations), the fp32 target verifies, so every prompt's output is the fp32 target's greedy output token for
    token, in the fast loop and in the decode loop; the drafts still get accepted (tau > 1)."""
    model, drafter, prompts = trained
    export_drafter(drafter, tmp_path / "d")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n"
                                              for i, p in enumerate(prompts)))
    args = ["--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "d"), "--prompts", str(tmp_path / "p.jsonl"),
            "--device", "cpu", "--max-new-tokens", "24", "--dtype", "float32", "--drafter-dtype", "bfloat16"]
    eos = eos_ids(model)
    for method in ("fast", "decode"):
        res = main(args + ["--method", method])
        assert res["measured_on"]["dtype"] == "float32" and res["measured_on"]["drafter_dtype"] == "bfloat16"
        assert "target float32, drafter bfloat16" in capsys.readouterr().out
        assert res["lossless"] and res["tau"] > 1 and res["prompts"] == len(prompts)
        for r, p in zip(res["per_prompt"], prompts):
            assert r["tokens"] == greedy_decode(model, p, 24, eos), (method, r["id"])


def test_rope_is_the_models_own_bit_for_bit():
    """rope() on q and k concatenated, with rotate_half's negation in the sin table, equals apply_rotary_pos_emb of
    every SUPPORTED family and the drafter's _apply_rope exactly."""
    torch.manual_seed(0)
    n, D = 7, 16
    cos, sin = rope_cos_sin(torch.arange(3, 3 + n), SimpleNamespace(head_dim=D, rope_theta=1e4, rope_scaling=None))
    q, k = torch.randn(1, n, 4, D), torch.randn(1, n, 2, D)                                       # [1, n, heads, D]
    qk = rope(torch.cat([q, k], dim=2), cos[None, :, None], rotated_sin(sin)[None, :, None])
    for family in SUPPORTED:
        hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
        want_q, want_k = hf(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])           # [1, heads, n, D]
        assert torch.equal(qk[:, :, :4].transpose(1, 2), want_q) and torch.equal(qk[:, :, 4:].transpose(1, 2), want_k)
    assert torch.equal(rope(q[0], cos[:, None], rotated_sin(sin)[:, None]), _apply_rope(q[0], cos, sin))


@pytest.mark.parametrize("sliding", [0, 1])
def test_draft_state_equals_drafter_step_and_context_kv_bit_for_bit(tiny_qwen3_dir, build_drafter, sliding):
    """DraftState.write (every layer's context K/V from one matmul, one cache write) equals Drafter.context_kv,
    and DraftState.hidden (fused q/k norm and RoPE, additive masks, GQA folded into the queries) equals
    Drafter.step over the same static rows (ctx_valid), GQA and a sliding layer included."""
    d = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B, sliding_window_layers=sliding,
                      sliding_window=6 if sliding else None).eval()
    torch.manual_seed(1)
    c, T, max_len = d.config, 20, 32
    embed, lm_head = torch.nn.Embedding(c.vocab_size, c.hidden_size), torch.nn.Linear(c.hidden_size, c.vocab_size)
    state = DraftState(d, embed, lm_head, B, max_len)
    feats, pos = torch.randn(T, c.num_taps * c.hidden_size), torch.arange(T)
    with torch.no_grad():
        state.write(feats, pos)
        for l, (k, v) in enumerate(d.context_kv(feats, pos)):
            assert torch.equal(state.kv[:T, l, 0], k) and torch.equal(state.kv[:T, l, 1], v)
        static = DrafterCache(d)          # the same rows, as Drafter.step reads a static cache
        static.kv, static.positions = [(state.kv[:, l, 0], state.kv[:, l, 1]) for l in range(2)], state.positions
        for start in (5, 13, T):
            block = torch.arange(start, start + B)
            token = torch.tensor([start % c.vocab_size])
            emb = embed(torch.cat([token, state.masks]))
            want = d.step(static, emb, block, ctx_valid=state.positions < start)
            assert torch.equal(state.hidden(token, block), want)


def test_step_kernel_counts(tiny_llama_dir):
    """tools/count_ops on a tiny Llama: no host sync in either step, the verify of B tokens runs the greedy step's
    layer kernels plus the two layout copies of its q and o per layer, masks are built once per step (no `where`
    in any layer), and the drafter's context K/V of all layers is one matmul and one cache write."""
    fast, d = count_ops.build(str(tiny_llama_dir), B, 2)
    greedy, spec = count_ops.count(fast._greedy_step), count_ops.count(lambda: fast._spec_step(d))
    for c in (greedy, spec):
        assert not {"_local_scalar_dense", "item"} & {op for ops in c.counts.values() for op in ops}
    g, s = greedy.counts[("target layers", "kernels")], spec.counts[("target layers", "kernels")]
    assert s - g == Counter(clone=2 * len(fast.layers)) and not g - s
    assert s["where"] == 0 and spec.counts[("drafter layers", "kernels")]["where"] == 0
    ctx = spec.counts[("context-cache update", "kernels")]
    assert ctx["mm"] == 2 and ctx["index_copy_"] == 1                      # fc, then every layer's k and v
    # --attention matmul: in every layer of both models, SDPA's kernels become one baddbmm, one softmax, one bmm
    fast_m, d_m = count_ops.build(str(tiny_llama_dir), B, 2, attention="matmul")
    spec_m = count_ops.count(lambda: fast_m._spec_step(d_m))
    for part, layers in (("target layers", len(fast.layers)), ("drafter layers", 2)):
        m = spec_m.counts[(part, "kernels")]
        assert not any("scaled_dot_product" in op for op in m), (part, m)
        assert (m["baddbmm"], m["_softmax"], m["bmm"]) == (layers, layers, layers), (part, m)


def test_step_timing_restarts_every_run(tiny_llama_dir):
    """tools/count_ops --time: every timed run starts from the prompt's end, so N runs fit caches sized for the prompt
    and two blocks (without the restart the third speculative step would write past them); bf16 builds too, and a
    bf16 drafter under an fp32 target (--drafter-dtype)."""
    for dtype, drafter_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)):
        fast, d = count_ops.build(str(tiny_llama_dir), B, 2, dtype=dtype, drafter_dtype=drafter_dtype)
        assert fast.max_len == len(count_ops.PROMPT) + 2 * B and d.kv.dtype == (drafter_dtype or dtype)
        ms = count_ops.time_steps(fast, d, 6)
        assert set(ms) == {"greedy", "speculative"} and all(v > 0 for v in ms.values())
        assert len(count_ops.PROMPT) + 1 <= int(fast.start) <= len(count_ops.PROMPT) + B


def test_fast_decoder_names_the_supported_families_for_a_gpt2():
    """A GPT-2 has no decoder `.layers`: the family check comes before any module is read, so the message names
    the supported families and the fallback instead of an AttributeError."""
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not one of .*--method decode"):
        FastDecoder(model, max_len=32)
