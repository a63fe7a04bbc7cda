"""FP8 matmuls where they are safe, through torchao (a kept library, not hand-written GEMMs): per-row scales, e4m3.

TARGET_FP8: the frozen target's decoder Linear layers up to the last tapped layer run as float8 dynamic activation x
float8 weight (`Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`): one scale per token row of the
input and per output channel of the weight, a float8 GEMM with bf16 output. The embedding and lm_head stay bf16
(the drafter's loss reads lm_head), and so do the layers past the last tap (never run for the features).

DRAFTER_FP8: the drafter's decoder-layer Linear layers train with torchao's float8 training (fp32 master weights as
before), in DRAFTER_FP8_RECIPE, one of torchao's recipes:
- rowwise_with_gw_hp (the default): the forward GEMM in float8 with per-row scales (input per token, weight per
  output channel), the input-gradient GEMM in float8 (output gradient per row, weight per tensor), the
  weight-gradient GEMM in bf16;
- rowwise: all three GEMMs in float8 with per-row scales; the weight gradient's operands are scaled along the token
  dimension, and those column-wise amax reductions cost more than the GEMMs save;
- tensorwise: one scale per tensor, gradients in e5m2, all three GEMMs in float8.
Their step times are in BENCHMARKS.md (other figures); rowwise_with_gw_hp is the default because it measured
fastest there. What stays bf16:
- the lm_head + CE: a plain matmul of the frozen target weight in model.objective, not an nn.Linear;
- fc: its input is the target's raw residual stream, whose massive-activation channels (10^3-10^4 x the median
  in Qwen/Llama-style models) would set each row's scale and push the rest of the row into e4m3's subnormals;
  it is ~1.5% of the step's FLOPs at 2048 blocks per 4 x 3072 tokens;
- the norms, RoPE and attention (flex_attention in bf16).
Use it with COMPILE_DRAFTER=layers: eager, the per-row scale and cast of every GEMM operand are separate kernels
(torchao's float8 training is written for torch.compile, which fuses them into the neighbouring ops).

HEAD_FP8: the loss's two GEMMs with the frozen lm_head (model.objective's chunked CE: logits = h @ W.T, and the
input gradient dL/dh = dL/dlogits @ W) in float8 through torch._scaled_mm, per-row scales: `HeadFP8` quantises W
once, per vocabulary row for the logits and per hidden unit for the gradient; each chunk's h is quantised per row
as it comes, and its dL/dlogits comes from the CE epilogue already divided by its row scales (model/ce_kernel.py: a
row's largest entry is known before the pass that writes it), so that operand costs one cast. At Qwen3-8B shapes
these two GEMMs are ~77 of the drafter step's 289 TFLOP at 2,048 blocks per 4 x 3072 tokens. The price: e4m3 keeps ~2^-4 relative precision per element, and the softmax's
smallest probabilities in a row (below ~4e-6 of its largest gradient entry) round to zero in dL/dlogits.

All three need FP8 tensor cores: an SM89+ GPU (Ada, Hopper or newer). check() says so before any model loads.
"""
import torch
import torch.nn as nn

MIN_CAPABILITY = (8, 9)     # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer
# not in requirements.txt: transformers imports torchao at start-up whenever it is installed (its quantizer
# registry), and torchao's prebuilt extensions print "Failed to load ..." where they do not fit (a CPU machine, another
# Python). Only the FP8 switches need it; they ask for it (check) before any model loads.
TORCHAO = "requirements-fp8.txt"


def check(name: str, device, fix: str = "") -> str | None:
    """None when `name` (TARGET_FP8, DRAFTER_FP8 or HEAD_FP8) can run on `device`, else the error line that says why
    and what to do (`fix`, default: the trainer's --NAME=False). HEAD_FP8 calls torch._scaled_mm itself: it needs
    no torchao."""
    device = torch.device(device)
    off = fix or f"set --{name}=False"
    need = f"{name} needs an SM89+ GPU (FP8 tensor cores: Ada, Hopper or newer)"
    if device.type != "cuda":
        return f"{need}; this run is on the {device.type}: {off}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"{need}; {torch.cuda.get_device_name(device)} is SM{cap[0]}{cap[1]}: {off}"
    if name == "HEAD_FP8":
        return None
    try:
        import torchao  # noqa: F401
    except ImportError:
        return f"{name} needs torchao, an optional package: pip install -r {TORCHAO}, or {off}"
    return None


def target_linears(decoder: nn.Module, last_layer: int) -> list[str]:
    """Names (inside `decoder`) of the nn.Linear modules of decoder layers 0..last_layer: what TARGET_FP8 quantises."""
    keep = {f"layers.{i}" for i in range(last_layer + 1)}
    return [n for n, m in decoder.named_modules() if isinstance(m, nn.Linear) and ".".join(n.split(".")[:2]) in keep]


def quantize_target(target) -> int:
    """TARGET_FP8 on a model.target.Target, in place, before Target.compile_layers (torchao's order: quantise,
    then compile). Returns the number of Linear layers quantised."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    names = set(target_linears(target.decoder, max(target.layer_ids)))
    # set_inductor_config=False: torchao's default turns on inductor's coordinate-descent tuning for the whole
    # process, and the drafter compiled after it then benchmarks every kernel's configs while it compiles: on an
    # H200 the one process sat > 200 s in the drafter's first compile, the GPU idle (2026-12-03)
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    quantize_(target.decoder, config, filter_fn=lambda m, fqn: fqn in names)
    return len(names)


def drafter_linears(drafter: nn.Module) -> list[str]:
    """Names of the drafter's nn.Linear modules DRAFTER_FP8 converts: every decoder layer's attention and MLP
    projections, not fc. DFlash2's small linears stay bf16: its convolutions' kernel projections (2 x taps x H/group
    outputs, whose coefficients scale every channel of a group) and its selector's hidden projection (outside the
    layers). float8 GEMMs need both dimensions in multiples of 16 (cuBLAS); any other layer stays bf16."""
    return [n for n, m in drafter.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")
            and "_conv." not in n and m.in_features % 16 == 0 and m.out_features % 16 == 0]


RECIPES = ("rowwise_with_gw_hp", "rowwise", "tensorwise")   # torchao's float8 training recipes (DRAFTER_FP8_RECIPE)


def convert_drafter(drafter: nn.Module, emulate: bool = False, recipe: str = RECIPES[0]) -> int:
    """DRAFTER_FP8 on a model.drafter.Drafter, in place, before the optimizer is built and before compile_drafter
    (the parameters stay the same fp32 tensors; only the modules around them change). recipe: one of RECIPES,
    torchao's names: rowwise (every GEMM operand per-row scaled, e4m3), tensorwise (one scale per tensor, e5m2
    gradients), rowwise_with_gw_hp (rowwise, the weight-gradient GEMM kept in bf16). emulate: torchao's emulation
    (float8 rounding, matmul in high precision), which runs on a CPU: tests only. Returns the number converted."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    assert recipe in RECIPES, f"DRAFTER_FP8_RECIPE {recipe!r} is not one of {RECIPES}"
    names = set(drafter_linears(drafter))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(drafter, config=config, module_filter_fn=lambda m, fqn: fqn in names)
    return len(names)


# --- HEAD_FP8 ---------------------------------------------------------------------------------------------------------

E4M3_MAX = 448.0
F8 = torch.float8_e4m3fn


def quantize_rows(x: torch.Tensor, inplace: bool = False):
    """x [M, K] (bf16 or fp32) -> (e4m3 [M, K], fp32 scales [M, 1]): per row, amax(|row|) maps to E4M3_MAX. The
    division runs in x's dtype with the scale rounded to it (that rounded scale is the one returned), so a bf16 [M, K]
    needs no fp32 copy; inplace divides x itself (a buffer nobody reads afterwards, such as the CE gradient)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(x.dtype)   # an all-zero row: any scale
    y = x.div_(scale) if inplace else x / scale
    return y.clamp_(-E4M3_MAX, E4M3_MAX).to(F8), scale.float()


def _scaled_mm(a, a_scale, b_t, b_scale, out_dtype):
    """a [M, K] e4m3 row-major, b_t [N, K] e4m3 row-major (b = b_t.t() is the column-major [K, N] the GEMM wants),
    scales [M, 1] and [1, N] fp32 -> a @ b in out_dtype, accumulated in fp32. Row-wise scales on Hopper need a bf16
    output: the product is made in bf16 and cast."""
    out = torch._scaled_mm(a, b_t.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


class HeadFP8:
    """The frozen lm_head [V, H] for HEAD_FP8, quantised once (2 x V x H bytes besides the bf16 weight, which stays
    for everything else): `rows` [V, H] scaled per vocabulary row (the logits GEMM's weight operand), `cols` [H, V] =
    W.T scaled per hidden unit (the input-gradient GEMM's). V and H must be multiples of 16 (FP8 GEMMs)."""

    ROWS_PER_PASS = 16384     # rows of W quantised at a time (its fp32 copy would be 2.5 GB at Qwen3's vocabulary)

    def __init__(self, weight: torch.Tensor):
        V, H = weight.shape
        assert V % 16 == 0 and H % 16 == 0, f"HEAD_FP8 needs the lm_head's [V, H] in multiples of 16, got [{V}, {H}]"
        self.weight = weight
        w = weight.detach()
        self.rows = torch.empty(V, H, dtype=F8, device=w.device)
        self.row_scale = torch.empty(V, 1, dtype=torch.float32, device=w.device)
        for s in range(0, V, self.ROWS_PER_PASS):
            self.rows[s:s + self.ROWS_PER_PASS], self.row_scale[s:s + self.ROWS_PER_PASS] = \
                quantize_rows(w[s:s + self.ROWS_PER_PASS].float())
        col_amax = w.abs().amax(dim=0, keepdim=True).float()                                    # [1, H]
        self.col_scale = (col_amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)       # [1, H]
        self.cols = torch.empty(H, V, dtype=F8, device=w.device)
        for s in range(0, V, self.ROWS_PER_PASS):
            part = (w[s:s + self.ROWS_PER_PASS].float() / self.col_scale).clamp_(-E4M3_MAX, E4M3_MAX)
            self.cols[:, s:s + self.ROWS_PER_PASS] = part.t().to(F8)
        self.row_scale_t = self.row_scale.t().contiguous()                                      # [1, V]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [c, H] -> h @ W.T [c, V] in bf16 (what the bf16 GEMM gives under autocast, whatever h's dtype)."""
        q, s = quantize_rows(h)
        return _scaled_mm(q, s, self.rows, self.row_scale_t, torch.bfloat16)

    def grad_input(self, g: torch.Tensor, out_dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
        """g [c, V] dL/dlogits -> g @ W [c, H] in out_dtype. scale [c, 1]: g is already divided by its per-row
        scales and within +-448 (the CE epilogue's fp8_rows), so it is only cast; without it g is quantised here,
        in place (overwritten)."""
        q, s = (g.to(F8), scale) if scale is not None else quantize_rows(g, inplace=True)
        return _scaled_mm(q, s, self.cols, self.col_scale, out_dtype)
