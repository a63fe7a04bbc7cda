"""TARGET_FP8 / DRAFTER_FP8 on a CPU: the refusal where FP8 cannot run, which layers each converts, and the FP8
numerics the CPU can run (torchao's per-row quantisation and torch._scaled_mm against an fp32 reference; torchao's
float8 training in its emulation mode; HEAD_FP8's GEMMs and loss, tests/helpers/fp8_cases.py). The FP8 GEMM kernels
themselves run only on an SM89+ GPU: tests/gpu/test_fp8_cuda.py checks HEAD_FP8's there, bench/fp8_h200.py measures
them; the trainer's refusals as real jobs are tests/jobs/test_fp8_jobs.py."""
import sys
import types

import pytest
import torch

from model import fp8
from fp8_cases import check_head_fp8_gemms, check_head_fp8_loss, head_case
from runs import cpu_rowwise_scaled_mm_missing


def needs_torchao():
    pytest.importorskip("torchao", reason="FP8 goes through torchao: pip install -r requirements-fp8.txt "
                                          "(FP8=1 bash launch.sh; .ci/run installs it for tests/unit/test_fp8.py)")


def test_fp8_needs_an_sm89_gpu(monkeypatch):
    assert fp8.check("TARGET_FP8", "cpu") == ("TARGET_FP8 needs an SM89+ GPU (FP8 tensor cores: Ada, Hopper or "
                                              "newer); this run is on the cpu: set --TARGET_FP8=False")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    msg = fp8.check("DRAFTER_FP8", torch.device("cuda", 0))
    assert msg.startswith("DRAFTER_FP8 needs an SM89+ GPU") and "A100-SXM4-80GB is SM80" in msg, msg
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.check("HEAD_FP8", torch.device("cuda", 0)) is None    # torch._scaled_mm alone: no torchao needed
    # on SM90 the answer turns on torchao alone, an optional package: both answers, whether or not it is installed
    monkeypatch.setitem(sys.modules, "torchao", None)                  # `import torchao` raises ImportError
    assert fp8.check("DRAFTER_FP8", torch.device("cuda", 0)) == (
        "DRAFTER_FP8 needs torchao, an optional package: pip install -r requirements-fp8.txt, or set --DRAFTER_FP8=False")
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    assert fp8.check("DRAFTER_FP8", torch.device("cuda", 0)) is None


def test_target_fp8_takes_the_linear_layers_up_to_the_last_tap(tiny_qwen3_dir):
    from model.target import Target
    t = Target(tiny_qwen3_dir, dtype=torch.float32, layer_ids=[1, 3])
    names = fp8.target_linears(t.decoder, max(t.layer_ids))
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"]
    assert names == [f"layers.{i}.{p}" for i in range(4) for p in per_layer]    # not 4, 5, the embedding, lm_head


def test_target_fp8_leaves_inductors_settings_alone(tiny_qwen3_dir, monkeypatch):
    """quantize_target converts the Linear layers up to the last tap and changes no process-wide inductor setting
    (torchao's default turns on coordinate-descent tuning, which made the drafter's compile after it take minutes).
    torchao's hardware check is bypassed: the CPU runs the conversion, not the FP8 GEMMs."""
    needs_torchao()
    import torch._inductor.config as inductor
    import torchao.quantization.quant_api as qa
    from model.target import Target
    monkeypatch.setattr(qa, "_check_hardware_support", lambda granularity: None)
    t = Target(tiny_qwen3_dir, dtype=torch.bfloat16, layer_ids=[1, 2])
    before = inductor.save_config_portable()
    assert fp8.quantize_target(t) == 3 * 7
    assert inductor.save_config_portable() == before
    kinds = {type(t.decoder.layers[i].mlp.up_proj.weight).__name__ for i in (0, 2)}
    assert kinds == {"Float8Tensor"} and type(t.decoder.layers[3].mlp.up_proj.weight) is torch.nn.Parameter


def test_rowwise_fp8_matmul_against_an_fp32_reference():
    """torchao's per-row float8 quantisation (what Float8DynamicActivationFloat8WeightConfig(PerRow()) applies to
    each weight and, per micro-batch, to each activation) and the scaled GEMM it calls on the GPU
    (torch._scaled_mm: e4m3 operands, one scale per row of each, fp32 accumulation), against the same arithmetic in
    fp32: scale = amax(|row|) / 448, round to e4m3, multiply back, matmul."""
    needs_torchao()
    from torchao.quantization import Float8Tensor, PerRow
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g) * 8).to(torch.bfloat16)  # [tokens, in]
    w = (torch.randn(96, 256, generator=g) * 0.02).to(torch.bfloat16)                               # [out, in]
    qx, qw = Float8Tensor.from_hp(x, granularity=PerRow()), Float8Tensor.from_hp(w, granularity=PerRow())

    def reference(t):   # [rows, in] -> the row-scaled e4m3 values in fp32, and the scales [rows, 1]
        scale = t.float().abs().amax(-1, keepdim=True) / 448.0
        return (t.float() / scale).to(torch.float8_e4m3fn).float() * scale, scale
    for t, q in ((x, qx), (w, qw)):
        deq, scale = reference(t)
        torch.testing.assert_close(q.scale.float(), scale, rtol=2 ** -7, atol=0)    # torchao keeps the scale
        torch.testing.assert_close(q.qdata.float() * q.scale.float(), deq, rtol=2 ** -3, atol=0)  # within a step
    ref = (qx.qdata.float() * qx.scale) @ (qw.qdata.float() * qw.scale).T                 # [tokens, out] fp32
    try:
        got = torch._scaled_mm(qx.qdata, qw.qdata.t(), scale_a=qx.scale.float(), scale_b=qw.scale.float().t(),
                               out_dtype=torch.float32)
    except RuntimeError as e:
        pytest.skip(f"this torch build has no CPU torch._scaled_mm with per-row scales ({e})")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # the price of FP8 itself, against the unquantised product: ~4% relative here, bf16 rounding ~0.2%
    exact = x.float() @ w.float().T
    err = ((got - exact).norm() / exact.norm()).item()
    bf16_err = (((x @ w.T).float() - exact).norm() / exact.norm()).item()
    assert 0.01 < err < 0.06 and bf16_err < err / 10, (err, bf16_err)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_drafter_fp8_trains_the_layers_in_fp8_and_keeps_fc(build_drafter, tiny_qwen3_dir, recipe):
    """convert_drafter with torchao's emulation (float8 rounding of every GEMM operand, forward and backward, the
    matmuls in high precision), in each DRAFTER_FP8_RECIPE: the same parameters and checkpoint keys, fc untouched,
    and loss and gradients near the bf16 ones but not equal to them (the conversion took effect)."""
    needs_torchao()
    from model.objective import weighted_ce
    torch.manual_seed(0)
    base = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=4)
    conv = build_drafter(tiny_qwen3_dir, num_layers=2, block_size=4)
    params = [id(p) for p in conv.parameters()]
    keys = list(conv.state_dict())
    n = fp8.convert_drafter(conv, emulate=True, recipe=recipe)
    assert n == 2 * 7 and fp8.drafter_linears(conv) == fp8.drafter_linears(base)
    assert [id(p) for p in conv.parameters()] == params and list(conv.state_dict()) == keys
    assert type(conv.fc) is torch.nn.Linear and type(conv.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    g = torch.Generator().manual_seed(0)
    T, N, B, H, V = 64, 6, 4, 64, 128
    feats = torch.randn(T, conv.config.num_taps * H, generator=g)
    anchors = torch.arange(N) * 10 + 2
    emb = torch.randn(N * B, H, generator=g)
    head = torch.randn(V, H, generator=g) * 0.05
    labels = torch.randint(0, V, (N * B,), generator=g)
    w = torch.rand(N * B, generator=g)
    grads = []
    for d in (base, conv):
        attn = d.attn_spec(anchors, torch.zeros_like(anchors), torch.zeros(T, dtype=torch.long))
        # rowwise_with_gw_hp's bf16 weight-gradient GEMM: torchao casts the input to the autocast dtype under CUDA
        # autocast only, so on a CPU it would meet an fp32 input; that recipe is checked in fp32 here
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe != "rowwise_with_gw_hp"):
            h = d(feats, torch.arange(T), emb, (anchors[:, None] + torch.arange(B)).flatten(), attn)
            loss = weighted_ce(h, head, labels, w, chunk_size=16).loss_sum
        loss.backward()
        grads.append((loss.detach(), torch.cat([p.grad.flatten() for p in d.parameters()])))
    (l0, g0), (l1, g1) = grads
    rel = ((g1 - g0).norm() / g0.norm()).item()
    assert l1 == pytest.approx(l0.item(), rel=0.02) and 0 < rel < 0.15, (l0, l1, rel)


# --- HEAD_FP8 ---------------------------------------------------------------------------------------------------------

def needs_scaled_mm():
    """HeadFP8 on a CPU needs torch._scaled_mm with per-row scales there: skip, with the reason, where it is missing."""
    if why := cpu_rowwise_scaled_mm_missing():
        pytest.skip(why)


def test_head_fp8_gemms_against_their_dequantised_operands():
    """HeadFP8's two GEMMs on the CPU against their dequantised operands multiplied in fp32
    (fp8_cases.check_head_fp8_gemms; on an SM89+ GPU: tests/gpu/test_fp8_cuda.py)."""
    needs_scaled_mm()
    check_head_fp8_gemms("cpu")


def test_quantize_rows_maps_each_rows_amax_to_e4m3s_largest_and_keeps_zero_rows():
    x = torch.tensor([[1.0, -4.0, 2.0], [0.0, 0.0, 0.0], [1e-30, 3e-30, -2e-30]])
    q, s = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 1)
    assert q.float().abs().amax(1).tolist() == [448.0, 0.0, 448.0]
    torch.testing.assert_close(q.float() * s, x, rtol=2 ** -3, atol=0)


@pytest.mark.parametrize("dpace", [False, True])
def test_head_fp8_loss_and_gradient_near_bf16(dpace):
    """weighted_ce through HeadFP8 on the CPU near the bf16 lm_head's, but not equal (fp8_cases.check_head_fp8_loss;
    on an SM89+ GPU: tests/gpu/test_fp8_cuda.py)."""
    needs_scaled_mm()
    check_head_fp8_loss("cpu", dpace)


def test_head_fp8_refuses_a_trainable_lm_head_and_odd_shapes():
    from model.objective import weighted_ce
    W, h, y, w = head_case()
    head = fp8.HeadFP8(W)
    head.weight = W.clone().requires_grad_()
    with pytest.raises(AssertionError, match="HEAD_FP8 quantises a frozen lm_head"):
        weighted_ce(h.clone().requires_grad_(), head, y, w, chunk_size=32)
    with pytest.raises(AssertionError, match=r"multiples of 16, got \[500, 64\]"):
        fp8.HeadFP8(W[:500])
