"""train_dflash.drafter_step, directly: one drafter step (the chunked, fused loss) against the same micro-batch's
plain unchunked weighted CE, its sums and its gradients; and MicroBatchSums' width. In-process, well under a
second."""
import copy

import pytest
import torch
from transformers import Qwen3Config

from conftest import TINY
from runs import trainer_cfg
from model.drafter import Drafter, DrafterConfig
from model.objective import weighted_ce
from train_dflash import drafter_step
from trainer.micro_batch import MicroBatchSums, autocast_for, make_prepare
from trainer.pipe import Packet

B = 4
STEP = trainer_cfg(SEED=0, MAX_ANCHORS=8, MIN_ANCHORS_PER_DOC=1, TOKEN_BUDGET=64, GAMMA=7.0, LOSS_WEIGHTING="exp",
                   DPACE_ALPHA=0.5, NOISE=0.0, CE_CHUNK=5, GRAD_CLIP=1.0, SELECTOR_ALPHA=1.0)


def micro_batch():
    """A tiny drafter, the frozen embedding and lm_head, and one prepared micro-batch of two sequences."""
    hf = Qwen3Config(**TINY)
    cfg = DrafterConfig.from_target(hf, 2, B, mask_token_id=hf.vocab_size - 1)
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    embed = torch.nn.Embedding(hf.vocab_size, hf.hidden_size).requires_grad_(False)
    head_w = torch.randn(hf.vocab_size, hf.hidden_size) * 0.05                            # [V, H]
    lengths = torch.tensor([12, 9])
    ids = torch.randint(0, hf.vocab_size - 1, (21,))                                      # [T]
    mask = torch.ones(21, dtype=torch.uint8)
    mask[:3] = 0                                                                          # a prompt: not supervised
    feats = torch.randn(21, cfg.num_taps * hf.hidden_size)                                # [T, K*H]
    item = make_prepare(cfg, "cpu", False, STEP)(Packet(0, lengths, ids, mask, feats))
    return drafter, embed, head_w, item


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_one_drafter_step_equals_the_unchunked_loss(weighting):
    drafter, embed, head_w, item = micro_batch()
    ref = copy.deepcopy(drafter)
    s = STEP.replace(LOSS_WEIGHTING=weighting)
    sums = drafter_step(drafter, embed, head_w, item, B, autocast_for(torch.device("cpu"), torch.float32), s)

    h = ref(item.features, item.ctx_pos, embed(item.block_ids), item.block_pos, item.attn)      # [N*B, H]
    plain = weighted_ce(h, head_w, item.labels, item.weights, 0)                               # unchunked, exp weights
    if weighting == "exp":
        plain.loss_sum.backward()
        assert float(sums.objective) == pytest.approx(float(plain.loss_sum.detach()), rel=1e-5)
        assert float(sums.objective_w) == pytest.approx(float(plain.weight_sum), rel=1e-6)
        for (name, p), q in zip(drafter.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the status line's loss is the exp-decay CE under either weighting
    assert float(sums.loss) == pytest.approx(float(plain.loss_sum.detach()), rel=1e-5)
    assert float(sums.loss_w) == pytest.approx(float(plain.weight_sum), rel=1e-6)
    assert 0 < float(sums.acc_den) and 0 <= float(sums.acc_num) <= float(sums.acc_den)
    assert float(sums.streak_den) == item.labels.numel() // B
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)


def test_micro_batch_sums_zeros_has_one_slot_per_field():
    z = MicroBatchSums.zeros(torch.device("cpu"))
    assert z.shape == (len(MicroBatchSums._fields),) and z.dtype == torch.float64 and not z.any()
