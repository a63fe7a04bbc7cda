"""The fast decode loop's cases, for tests/unit/test_fastdecode.py (CPU, eager) and tests/gpu/test_fastdecode_cuda.py
(CUDA graphs): block size B, MAX_NEW tokens, the fp32 HF model of a folder, random prompts, and the fixture `trained`
(the tiny Qwen3 target, a briefly trained drafter that accepts often, its prompts). A test module imports the fixture
by name."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

from model.decode import DrafterProposer, greedy_decode, target_forward

B = 4
MAX_NEW = 40


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                local_files_only=True).eval()


def random_prompts(vocab, lengths=(1, 5, 13, 30), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def train_briefly(drafter, model, prompts, steps=20):
    """A few Adam steps of the drafter's training forward (every generated position an anchor, CE on slots
    1..B-1) on the target's own greedy continuations: enough to accept 0..B-1 drafts, not to accept everything."""
    proposer = DrafterProposer(drafter, model)
    data = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor(p + greedy_decode(model, p, MAX_NEW, set()))                     # [L]
            _, feats = target_forward(model, ids, torch.arange(len(ids)), DynamicCache(), proposer.layer_ids)
            data.append((ids, feats, len(p)))
    k, opt = torch.arange(B), torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = 0
        for ids, feats, P in data:
            L = len(ids)
            anchors = torch.arange(P, L - 1)                                                     # [N]
            block = torch.where(k[None] == 0, ids[anchors][:, None], drafter.config.mask_token_id)   # [N, B]
            zeros = torch.zeros(L, dtype=torch.long)
            h = drafter(feats, torch.arange(L), proposer.embed(block.flatten()), (anchors[:, None] + k).flatten(),
                        drafter.attn_spec(anchors, zeros[:len(anchors)], zeros))                 # [N*B, H]
            idx = anchors[:, None] + k[1:]                                                       # [N, B-1]
            logits = proposer.lm_head(h.view(len(anchors), B, -1)[:, 1:])                        # [N, B-1, V]
            loss = loss + F.cross_entropy(logits[idx < L], ids[idx[idx < L]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def trained(tiny_qwen3_dir, build_drafter):
    """(the tiny Qwen3 target, a drafter trained on its greedy continuations of the prompts, the prompts)."""
    model = load(tiny_qwen3_dir)
    prompts = random_prompts(128, (3, 11, 26, 7))
    return model, train_briefly(build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B), model, prompts), prompts
