"""model/engine.py against transformers' generate: greedy token for token on tiny random Llama and Qwen3 (and on
SmolLM2 when present) with fewer slots than prompts and stop ids hit mid-way; the Gumbel sampler's determinism
per (seed, key) and its distribution; refusals; regenerate's fast engine writing what --engine hf writes. CPU, fp32."""
import json

import pytest
import torch

from conftest import SMOLLM2_DIR
from data import regenerate as regen
from collections import deque

from model.engine import Engine, Request, _fold, _mix32, default_stop_ids, gumbel_argmax, key_hash, load_model



def tiny_model(family: str, vocab=96, layers=2):
    import transformers
    torch.manual_seed(0)
    cfg = getattr(transformers, family + "Config")(
        vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, num_hidden_layers=layers, max_position_embeddings=512,
        initializer_range=0.2)  # large weights: clear argmax margins, so rounding order cannot flip a greedy pick
    return getattr(transformers, family + "ForCausalLM")(cfg).eval()


def hf_greedy(model, prompt, max_new, stop_ids):
    """transformers' generate on one unpadded prompt -> (ids without the stop token, finish reason)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=stop_ids or None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(out) if t in stop_ids), None)
    return (out, "length") if cut is None else (out[:cut], "stop")


@pytest.mark.parametrize("family,attention", [("Llama", "sdpa"), ("Qwen3", "sdpa"), ("Qwen3", "matmul")])
def test_greedy_matches_hf_generate(family, attention):
    model = tiny_model(family)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (1, 37, 5, 12, 60, 3, 23, 8)]
    max_new = [20, 9, 20, 1, 30, 20, 14, 20]
    stop = hf_greedy(model, prompts[0], 20, [])[0][4]   # prompt 0's 5th token: a stop that some rows hit mid-way
    ref = [hf_greedy(model, p, m, [stop]) for p, m in zip(prompts, max_new)]
    assert {why for _, why in ref} == {"stop", "length"} and any(why == "stop" and ids for ids, why in ref)
    engine = Engine(model, max_batch=3, max_len=96, attention=attention)  # 3 slots for 8 prompts: slots refilled
    got = {i: (ids, why) for i, ids, why in engine.generate(prompts, max_new_tokens=max_new, stop_ids=[stop])}
    assert [got[i] for i in range(len(prompts))] == ref
    assert engine.stats["prompts"] == 8 and engine.stats["generated"] == sum(
        len(ids) + (why == "stop") for ids, why in ref)
    assert len(engine.buckets) > 1  # short contexts attended over a shorter cache bucket


def test_smollm2_chat_prompts_match_hf_generate():
    if not (SMOLLM2_DIR / "model.safetensors").exists():
        pytest.skip(f"no SmolLM2 folder at {SMOLLM2_DIR}: build it with `.venv/bin/python -m tools.smollm2`")
    model, tok = load_model(SMOLLM2_DIR, device="cpu")
    stop_ids = default_stop_ids(model, tok)
    chats = ["What is AI?", "Name three colors.", "Hi", "Write one sentence about the sea."]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for c in chats]
    ref = [hf_greedy(model, p, 24, stop_ids) for p in prompts]
    got = {i: (ids, why) for i, ids, why in Engine(model, max_batch=2, max_len=128).generate(
        prompts, max_new_tokens=24, stop_ids=stop_ids)}
    assert [got[i] for i in range(len(prompts))] == ref


def test_sampling_depends_only_on_seed_and_key():
    model = tiny_model("Qwen3")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 17, 9, 30, 2, 11)]

    def run(slots, idx, seed=0):
        engine = Engine(model, max_batch=slots, max_len=64, seed=seed)
        out = engine.generate([prompts[i] for i in idx], max_new_tokens=16, temperature=1.0, stop_ids=[],
                              keys=[100 + i for i in idx])
        return {idx[j]: ids for j, ids, _ in out}

    alone = run(2, [0, 1, 2])
    mixed = run(5, [5, 2, 4, 0, 3, 1])                  # other neighbours, other slots, other order
    assert {i: mixed[i] for i in alone} == alone
    assert run(2, [0, 1, 2], seed=1) != alone            # the seed changes the draw
    greedy = {i: ids for i, ids, _ in Engine(model, max_batch=2, max_len=64).generate(
        [prompts[i] for i in range(3)], max_new_tokens=16, stop_ids=[])}
    assert [greedy[i] for i in range(3)] != [alone[i] for i in range(3)]   # it does sample


def test_run_streams_follow_ups_and_mixes_temperatures():
    """One run fed as it goes: each result's follow-up (its prompt + answer + a new token, sampled or greedy by
    turns) joins the running batch; every output equals what a separate generate call with the same temperature,
    key and cap gives, so per-request temperatures and streaming change nothing a request sees."""
    model = tiny_model("Qwen3")
    g = torch.Generator().manual_seed(3)
    firsts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 19, 7, 26, 1, 12, 5)]
    temp = lambda turn: 0.8 if turn % 2 else 0.0  # noqa: E731

    def alone(prompt, turn, key):
        out = Engine(model, max_batch=1, max_len=128).generate([prompt], max_new_tokens=6 + turn,
                                                                temperature=temp(turn), stop_ids=[], keys=[key])
        return next(out)[1]

    engine = Engine(model, max_batch=3, max_len=128)
    pending = deque(Request(p, 6, temp(0), 10 * i, (i, 0, p)) for i, p in enumerate(firsts))
    got = {}
    for r, ids, why in engine.run(pending, stop_ids=[], sampled=True):
        i, turn, prompt = r.tag
        got[i, turn] = (prompt, ids)
        if turn < 2:                     # the follow-up: this context + its answer + one more token
            nxt = prompt + ids + [turn + 1]
            pending.append(Request(nxt, 6 + turn + 1, temp(turn + 1), 10 * i + turn + 1, (i, turn + 1, nxt)))
    assert sorted(got) == [(i, t) for i in range(len(firsts)) for t in range(3)]
    for (i, turn), (prompt, ids) in got.items():
        assert ids == alone(prompt, turn, 10 * i + turn), (i, turn)
    assert engine.stats["prompts"] == 3 * len(firsts)
    with pytest.raises(ValueError, match="start the run with sampled=True"):
        list(engine.run(deque([Request([1, 2], 3, 0.0), Request([3], 3, 0.5)]), stop_ids=[], sampled=False))


@pytest.mark.slow  # ~20 s: one torch.compile of the sampler (on the GPU run by dev/throughput_h200.sh's tests)
def test_compiled_sampler_draws_what_the_eager_one_draws():
    """compile_sampler=True: the decode step's fused draw gives the same sampled and greedy rows as the eager one
    (CUDA graphs on when a GPU is there), so it is only a speed switch."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("Qwen3").to(dev)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 14, 2, 9, 21, 7)]

    def rows(compiled):
        engine = Engine(model, max_batch=4, max_len=64, compile_sampler=compiled)
        reqs = deque(Request(p, 12, 0.9 if i % 3 else 0.0, 50 + i, i) for i, p in enumerate(prompts))
        return {r.tag: ids for r, ids, _ in engine.run(reqs, stop_ids=[], sampled=True)}
    assert rows(True) == rows(False)


@pytest.mark.parametrize("vary", ["key", "position"])
def test_gumbel_sampler_matches_softmax(vary):
    """40,000 draws from one logits row, over consecutive keys (or positions): the counts pass a chi-square test
    against softmax(logits / T) (5 degrees of freedom; 20.5 is its 0.1% tail), so the sampler is exact."""
    T, n = 0.7, 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    counter = torch.arange(n)
    rows = _fold(key_hash(0, counter), torch.full_like(counter, 7)) if vary == "key" else \
        _fold(key_hash(0, torch.full_like(counter, 3)), counter)
    draws = gumbel_argmax((logits / T).expand(n, -1), rows, _mix32(torch.arange(6)))
    expected = n * torch.softmax(logits / T, -1)
    chi2 = (((torch.bincount(draws, minlength=6) - expected) ** 2) / expected).sum().item()
    assert chi2 < 20.5, chi2
    # and a skewed row is not passed by accident: the same counts fail against uniform
    assert (((torch.bincount(draws, minlength=6) - n / 6) ** 2) / (n / 6)).sum().item() > 1000


def test_refusals():
    engine = Engine(tiny_model("Llama"), max_batch=2, max_len=32)
    with pytest.raises(ValueError, match=r"30 tokens \+ 8 new tokens exceeds the engine's max_len 32: raise --max-len"):
        list(engine.generate([[1] * 5, [1] * 30], max_new_tokens=8, stop_ids=[]))
    with pytest.raises(ValueError, match="stop_ids"):
        list(engine.generate([[1]], max_new_tokens=2, stop_ids=[96]))
    bad = tiny_model("Llama")
    bad.config.model_type = "gemma"
    with pytest.raises(ValueError, match="use --engine hf"):
        Engine(bad)


def test_regenerate_fast_engine_writes_what_hf_writes(tmp_path, tiny_smollm2):
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    rows = [{"id": "a", "messages": [user("What is AI?")]},
            {"id": "b", "messages": [{"role": "system", "content": "Be terse."}, user("q1"),
                                     {"role": "assistant", "content": "old"}, user("And the second question?")]},
            {"id": "c", "messages": [user("Tell me a joke about cats, please.")]},
            {"id": "d", "messages": [user("Hi")]},
            {"id": "e", "messages": [user("a long one " * 80)]}]
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(out, *extra):
        regen.main(["--input", str(inp), "--output", str(out), "--model", str(tiny_smollm2), "--device", "cpu",
                    "--max-new-tokens", "6", "--batch-size", "2", *extra])
        return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}

    hf, fast = run(tmp_path / "hf.jsonl", "--engine", "hf"), run(tmp_path / "fast.jsonl")
    assert set(fast) == set("abcde") and fast == hf
    assert len(fast["b"]["finish_reasons"]) == 2 and [m["role"] for m in fast["b"]["messages"]][-2:] == \
        ["user", "assistant"]
    # a prompt that does not fit --max-len fails alone, with the fix in its error; the others are written
    short = tmp_path / "short.jsonl"
    assert set(run(short, "--max-len", "160")) == set("abcd")
    (err,) = map(json.loads, (tmp_path / "short.jsonl.errors.jsonl").read_text().splitlines())
    assert err["id"] == "e" and "raise --max-len" in err["error"]


def test_other_families_get_the_message_not_an_attribute_error():
    """A GPT-2-style model has no decoder.layers: the engine names the families it runs before reading them."""
    import transformers
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not one of \('llama', 'mistral', 'qwen2', "
                                         r"'qwen3'\).*use --engine hf"):
        Engine(model, max_batch=2, max_len=32)
