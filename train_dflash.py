"""Train a DFlash drafter in one torchrun job: target ranks run the frozen target and stream hidden states to
drafter ranks, which train the drafter with DDP among themselves (or shard it with FSDP2: DRAFTER_SHARDING). No
external services. The algorithm:
docs/ALGORITHM.md; the route of a micro-batch and the role of each file: ARCHITECTURE.md.

    bash launch.sh                                                     # the usual way (tmux, log, allocator)
    torchrun --nproc-per-node 8 train_dflash.py --TARGET=/models/Qwen3-8B --DATA=/data/prepared --TARGET_RANKS=5
    python train_dflash.py --MAX_STEPS=20                              # one process: target and drafter in turn

Every constant below can be overridden as --NAME=VALUE. The final values are printed, saved in OUT_DIR/run.json
and in every checkpoint.
"""
import contextlib
import difflib
import functools
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import checkpoint as ckpt
import eval_dflash
import planner
from data.loader import Data, DataError, Schedule, read_stats, tokenizer_mismatches
from model import fp8
from model.attention import set_flex_kernel_options, static_lengths, warmup_flex_attention
from model.drafter import COMPILE_MODES, Drafter, DrafterConfig, compile_drafter
from model.export import export_drafter
from model.objective import block_metrics, dpace_reweight, micro_seed, prepare, weighted_ce
from model.target import (DEFAULT_TARGET, Target, check_mask_token_id, default_mask_token_id, load_frozen_io)
from optim import make_optimizer, scale_clip_
from pipe import BusyClock, Prefetcher, Replica, Sender, StopPoint, TargetAhead, Watchdog, produce, receive

_IMPORTED = set(globals())   # names above are not settings (CONFIG_KEYS below)

# --- what to train --------------------------------------------------------------------------------------------------
TARGET = ""                 # local HF folder of the frozen target; "" = SmolLM2-135M-Instruct (python -m tools.smollm2)
DATA = ""                   # prepared dataset folder (python -m data.prepare); "" = data/default/smollm2
OUT_DIR = "runs/dflash"     # checkpoints/, metrics.jsonl, run.json (launch.sh adds train.log)
INIT_FROM = ""              # exported drafter folder (serving format, e.g. runs/x/checkpoints/step_N/drafter) to start
#                             from; "" = random init. A fresh run (step 0, new optimizer); a checkpoint to resume wins
NUM_DRAFT_LAYERS = 5        # L, drafter decoder layers
TARGET_LAYER_IDS = ""       # comma list of target layers to tap, e.g. "1,9,17,25,33"; "" = spread NUM_TAPS evenly
NUM_TAPS = 0                # K when TARGET_LAYER_IDS is "": 0 = NUM_DRAFT_LAYERS
BLOCK_SIZE = 16             # B, tokens per block: the anchor + B-1 drafted
MASK_TOKEN_ID = -1          # -1 = first unused id past the tokenizer (or an unused special token)
SLIDING_WINDOW_LAYERS = 0   # last S drafter layers use sliding-window attention (causal inside the block)
SLIDING_WINDOW = 0          # their window in tokens; 0 = the target's config value

# --- objective ------------------------------------------------------------------------------------------------------
MAX_ANCHORS = 2048          # blocks per micro-batch (anchors sampled without replacement, fresh every step); 125 per
                            # 1K tokens at TOKEN_BUDGET 16384 (BENCHMARKS.md section 6: density at equal GPU time)
MIN_ANCHORS_PER_DOC = 1     # floor per sequence when MAX_ANCHORS binds, so short sequences are not starved
GAMMA = 7.0                 # LOSS_WEIGHTING=exp: weight of slot k is exp(-(k-1)/GAMMA); 7 for B=16, 10 for B=32
LOSS_WEIGHTING = "dpace"    # dpace (D-PACE, vLLM speculators' default; +0.10 tau over exp, BENCHMARKS.md section 6)
                            # | exp (exp(-(k-1)/GAMMA), the paper's)
DPACE_ALPHA = 0.5           # D-PACE confidence smoothing in [0, 1]: slot weights from (1-a)*q + a, q = p(label)
NOISE = 0.0                 # uniform noise U(-NOISE, NOISE) on target hidden states before fc (0 = off)
CE_CHUNK = 4096             # rows of [rows, vocab] logits alive at once in the loss (0 = unchunked, tests only)

# --- data -----------------------------------------------------------------------------------------------------------
TOKEN_BUDGET = 16384        # tokens per micro-batch, padding included (target forward is [b, S] padded)
MAX_BATCH_SIZE = 64         # sequences per micro-batch
EPOCHS = 6                  # passes over the data (when MAX_STEPS is 0)
ALLOW_DATA_CHANGE = False   # resume even if the dataset changed (the LR schedule is re-planned over the new total)

# --- optimisation ---------------------------------------------------------------------------------------------------
GRAD_ACCUM = 1              # micro-batches per drafter rank per optimizer step
LR = 6e-4                   # peak learning rate (AdamW, fp32 master weights)
WARMUP_RATIO = 0.04         # fraction of the run spent in linear warmup, then cosine to 0
WEIGHT_DECAY = 0.0          # AdamW weight decay (0.0 - 0.01)
GRAD_CLIP = 1.0             # max global grad norm
MAX_STEPS = 0               # optimizer steps of the run, repeating the data as needed (EPOCHS is then unused); 0 =
                            # EPOCHS over the data. The LR schedule spans the run

# --- topology and hardware --------------------------------------------------------------------------------------------
TARGET_RANKS = 1            # the first TARGET_RANKS ranks run the target, the rest train the drafter
TARGET_SHARDS = 1           # target ranks per replica: each holds 1/N of the target (FSDP2); divides TARGET_RANKS
DEVICE = "auto"             # auto | cuda | cpu
DTYPE = "auto"              # auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float32
ATTN = "auto"               # auto (flex on GPU, sdpa on CPU) | flex | sdpa
COMPILE_DRAFTER = "off"     # off | elementwise (fused RMSNorm + RoPE kernels) | layers (that + each layer one graph)
COMPILE_TARGET = False      # torch.compile each target decoder layer (one process: run on the main thread, one ahead)
TARGET_FP8 = False          # frozen target's Linear layers in FP8 (rowwise scales) on GPU (SM89+, torchao)
DRAFTER_FP8 = False         # drafter Linear layers trained in FP8 (torchao float8 training, DRAFTER_FP8_RECIPE)
                            # with HEAD_FP8 and COMPILE_DRAFTER=layers: 1.24x the drafter step at Qwen3-8B shapes,
                            # tau within noise; slower at small hidden sizes (BENCHMARKS.md section 2)
DRAFTER_FP8_RECIPE = "rowwise_with_gw_hp"   # | rowwise | tensorwise: torchao's recipes (model/fp8.py)
HEAD_FP8 = False            # the loss's two lm_head GEMMs (logits, input gradient) in FP8, per-row scales (SM89+)
DRAFTER_SHARDING = "ddp"    # ddp (every drafter rank holds all weights, grads, AdamW) | fsdp (FSDP2: 1/D of each)
FLEX_OPTIONS = ""           # JSON kernel_options of the drafter's flex_attention, '{"USE_TMA": true}'; "" = torch's
OVERLAP_OPTIMIZER = True    # GPU: AdamW on a side stream, layer by layer, under the next forward (optim.py)
Q_PREFETCH = 4              # q_pre: padded batches a target rank prepares ahead
Q_HS = 8                    # q_hs: received micro-batches a drafter rank holds ahead of compute
SEND_DEPTH = 2              # feature tensors a target rank may have in flight

# --- checkpoints, logging, failure ------------------------------------------------------------------------------------
SAVE_EVERY = 500            # optimizer steps between checkpoints (also saved at the end and on SIGTERM/SIGINT)
KEEP_LAST = 3               # checkpoints kept
RESUME = "auto"             # auto (newest complete checkpoint in OUT_DIR, else start) | scratch | <checkpoint path>
SEED = 0                    # drafter init, anchor sampling and noise (per micro-batch, so resume is exact)
LOG_EVERY = 10              # optimizer steps between status lines
LOG_SECONDS = 60.0          # ... or at most this many seconds
HEARTBEAT_TIMEOUT = 30.0    # s without a heartbeat before a rank is declared dead
STALL_TIMEOUT = 600.0       # s without progress on any rank (after start-up) before the job is ended
EVAL_EVERY = 0              # run the tau evaluation on every N-th checkpoint (0 = off); on the master drafter rank
EVAL_PROMPTS = ""           # prompts JSONL for it ("" = data/default/eval_prompts.jsonl)
EVAL_LIMIT = 16             # prompts per evaluation
EVAL_MAX_NEW_TOKENS = 128   # tokens generated per prompt
EVAL_DTYPE = "float32"      # target dtype for it: float32 keeps the losslessness check exact (bf16 block vs
#                             one-token forwards round differently, which can flip near-tied greedy tokens)
TENSORBOARD = False         # also log to OUT_DIR/tb
WANDB_PROJECT = ""          # also log to this W&B project ("" = off)
DRY_RUN = False             # check the config and data, print the plan, exit before loading any model
DUMP_BATCHES = 0            # drafters save the first N received micro-batches to OUT_DIR/dump/ (debugging, tests)

CONFIG_KEYS = [k for k in list(globals()) if k.isupper() and not k.startswith("_") and k not in _IMPORTED]
REPO = Path(__file__).resolve().parent
SECOND_SIGNAL_S = 2.0       # a signal this long after the first ends the job now; sooner it is the same one, forwarded
# Allowed range of every numeric constant: name -> (bound, strict). strict: value > bound, else value >= bound.
# Floats must also be finite. check_config enforces it (tests check that every numeric constant is listed).
RANGES = {
    "NUM_DRAFT_LAYERS": (1, False), "NUM_TAPS": (0, False), "BLOCK_SIZE": (2, False), "MASK_TOKEN_ID": (-1, False),
    "SLIDING_WINDOW_LAYERS": (0, False), "SLIDING_WINDOW": (0, False),
    "MAX_ANCHORS": (1, False), "MIN_ANCHORS_PER_DOC": (0, False), "GAMMA": (0, True), "DPACE_ALPHA": (0, False),
    "NOISE": (0, False),
    "CE_CHUNK": (0, False),
    "TOKEN_BUDGET": (2, False), "MAX_BATCH_SIZE": (1, False), "EPOCHS": (1, False),
    "GRAD_ACCUM": (1, False), "LR": (0, True), "WARMUP_RATIO": (0, False), "WEIGHT_DECAY": (0, False),
    "GRAD_CLIP": (0, True), "MAX_STEPS": (0, False),
    "TARGET_RANKS": (1, False), "TARGET_SHARDS": (1, False), "Q_PREFETCH": (1, False), "Q_HS": (1, False),
    "SEND_DEPTH": (1, False),
    "SAVE_EVERY": (1, False), "KEEP_LAST": (0, False), "SEED": (0, False), "LOG_EVERY": (1, False),
    "LOG_SECONDS": (0, True), "HEARTBEAT_TIMEOUT": (0, True), "STALL_TIMEOUT": (0, True), "EVAL_EVERY": (0, False),
    "EVAL_LIMIT": (1, False), "EVAL_MAX_NEW_TOKENS": (1, False), "DUMP_BATCHES": (0, False),
}


# --- configuration ----------------------------------------------------------------------------------------------------

_GIVEN: set[str] = set()      # the names set on the command line (parse_overrides)


def parse_overrides(argv: list[str]) -> dict:
    """--NAME=VALUE for the constants above; unknown names and wrong types are errors."""
    g = globals()
    _GIVEN.clear()
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            sys.exit(f"error: arguments are --NAME=VALUE, got {arg!r}")
        name, value = arg[2:].split("=", 1)
        if name not in CONFIG_KEYS:
            close = difflib.get_close_matches(name, CONFIG_KEYS, n=3)
            sys.exit(f"error: unknown setting --{name}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                     + f"; settings are the constants at the top of {Path(__file__).name}")
        default = g[name]
        try:
            if isinstance(default, bool):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError
                g[name] = value.lower() in ("1", "true", "yes")
            else:
                g[name] = type(default)(value)
        except ValueError:
            sys.exit(f"error: --{name}={value!r} is not a valid {type(default).__name__} (default: {default!r})")
        _GIVEN.add(name)
    return {k: g[k] for k in CONFIG_KEYS}


def resolve_paths() -> None:
    """Fill the embedded defaults: SmolLM2 from the cache (model.target.DEFAULT_TARGET), the shipped dataset."""
    global TARGET, DATA
    if not TARGET:
        TARGET = str(DEFAULT_TARGET)
        if not (DEFAULT_TARGET / "config.json").exists():
            sys.exit(f"error: no TARGET given and the default SmolLM2 folder {DEFAULT_TARGET} does not exist: run "
                     f"`python -m tools.smollm2` (launch.sh does) or pass --TARGET=/path/to/hf/model")
    if not DATA:
        DATA = str(REPO / "data" / "default" / "smollm2")
def check_config(world: int) -> None:
    """Contradictions a user can fix, reported before any model is loaded."""
    errs = []
    if world > 1 and not 1 <= TARGET_RANKS < world:
        errs.append(f"TARGET_RANKS={TARGET_RANKS} must be between 1 and world size - 1 = {world - 1} "
                    f"(at least one drafter rank); launch more processes or lower TARGET_RANKS")
    if TARGET_SHARDS > 1:
        if world == 1:
            errs.append(f"TARGET_SHARDS={TARGET_SHARDS} needs a torchrun job: one process runs the whole target; "
                        f"launch TARGET_RANKS + drafter processes or set TARGET_SHARDS=1")
        elif TARGET_RANKS % TARGET_SHARDS:
            errs.append(f"TARGET_RANKS={TARGET_RANKS} is not a multiple of TARGET_SHARDS={TARGET_SHARDS} (each target "
                        f"replica spans TARGET_SHARDS ranks): set TARGET_RANKS to a multiple of it")
        for name, why in (("COMPILE_TARGET", "torch.compile would trace FSDP's all-gather hooks inside each layer"),
                          ("TARGET_FP8", "torchao's FP8 weights cannot be sharded and all-gathered by FSDP")):
            if globals()[name]:
                errs.append(f"{name} does not work with TARGET_SHARDS={TARGET_SHARDS} ({why}): set --{name}=False "
                            f"or TARGET_SHARDS=1")
    for name, (lo, strict) in RANGES.items():
        v = globals()[name]
        if not math.isfinite(v) or (v <= lo if strict else v < lo):
            errs.append(f"{name}={v} must be {'>' if strict else '>='} {lo:g}"
                        + (" and finite" if isinstance(v, float) else ""))
    if not WARMUP_RATIO < 1:
        errs.append(f"WARMUP_RATIO={WARMUP_RATIO} must be < 1 (the fraction of the run spent warming up)")
    if SLIDING_WINDOW_LAYERS > NUM_DRAFT_LAYERS:
        errs.append(f"SLIDING_WINDOW_LAYERS={SLIDING_WINDOW_LAYERS} must be <= NUM_DRAFT_LAYERS={NUM_DRAFT_LAYERS}")
    if LOSS_WEIGHTING not in ("exp", "dpace"):
        errs.append(f"LOSS_WEIGHTING={LOSS_WEIGHTING!r}: allowed are exp, dpace")
    if not DPACE_ALPHA <= 1:
        errs.append(f"DPACE_ALPHA={DPACE_ALPHA} must be <= 1 (D-PACE's confidence smoothing lies in [0, 1])")
    if DEVICE not in ("auto", "cuda", "cpu") or DTYPE not in ("auto", "bfloat16", "float32") or \
            ATTN not in ("auto", "flex", "sdpa"):
        errs.append(f"DEVICE={DEVICE!r} DTYPE={DTYPE!r} ATTN={ATTN!r}: allowed are auto|cuda|cpu, "
                    f"auto|bfloat16|float32, auto|flex|sdpa")
    if RESUME not in ("auto", "scratch") and not Path(RESUME).exists():
        errs.append(f"RESUME={RESUME!r} is neither auto, scratch nor an existing checkpoint folder")
    if INIT_FROM and not all((Path(INIT_FROM) / f).is_file() for f in ("config.json", "model.safetensors")):
        errs.append(f"INIT_FROM={INIT_FROM} is not an exported drafter folder (config.json + model.safetensors, "
                    f"e.g. runs/x/checkpoints/step_N/drafter)")
    if Path(OUT_DIR).exists() and not Path(OUT_DIR).is_dir():
        errs.append(f"OUT_DIR={OUT_DIR} is a file, not a folder: point OUT_DIR at a folder (it is created if missing)")
    tgt = Path(TARGET).expanduser()
    if not (tgt / "config.json").exists():
        errs.append(f"TARGET={TARGET} has no config.json: it must be a local Hugging Face model folder")
    else:
        tcfg = json.loads((tgt / "config.json").read_text())
        arch = tcfg.get("architectures") or []
        if not any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in arch):
            errs.append(f"TARGET={TARGET} is not a causal LM (architectures={arch}); DFlash needs a decoder-only "
                        f"*ForCausalLM target")
        elif not any(next(tgt.glob(pat), None) for pat in ckpt.WEIGHT_FILES):
            errs.append(f"TARGET={TARGET} has a config.json but no weights ({', '.join(ckpt.WEIGHT_FILES)}): "
                        f"download the model's weight files into it")
        if HEAD_FP8:
            tc = tcfg.get("text_config", tcfg)
            V, H = tc.get("vocab_size", 0), tc.get("hidden_size", 0)
            if V % 16 or H % 16:
                errs.append(f"HEAD_FP8 needs the target's lm_head [vocab_size, hidden_size] = [{V}, {H}] in multiples "
                            f"of 16 (FP8 GEMMs): set --HEAD_FP8=False")
    if HEAD_FP8 and not CE_CHUNK:   # the unchunked loss is the bf16 reference: HEAD_FP8 would do nothing there
        errs.append("HEAD_FP8 runs in the chunked loss only, and CE_CHUNK=0 is the unchunked reference: set "
                    "--CE_CHUNK=4096 or --HEAD_FP8=False")
    if FLEX_OPTIONS:
        try:
            if not isinstance(json.loads(FLEX_OPTIONS), dict):
                raise ValueError
        except ValueError:
            errs.append(f"FLEX_OPTIONS={FLEX_OPTIONS!r} is not a JSON object of flex_attention kernel_options "
                        f"(e.g. '{{\"USE_TMA\": true}}'; \"\" for torch's defaults)")
    if DRAFTER_SHARDING not in ("ddp", "fsdp"):
        errs.append(f"DRAFTER_SHARDING={DRAFTER_SHARDING!r}: allowed are ddp, fsdp")
    elif DRAFTER_SHARDING == "fsdp" and world == 1:
        errs.append("DRAFTER_SHARDING=fsdp shards the drafter over the drafter ranks of a torchrun job; the one "
                    "process holds it whole: launch with torchrun (launch.sh), or use DRAFTER_SHARDING=ddp")
    elif DRAFTER_SHARDING == "fsdp" and DRAFTER_FP8:
        errs.append("DRAFTER_FP8 with DRAFTER_SHARDING=fsdp is not supported yet (float8 weights would need FSDP2's "
                    "float8 all-gather): use one of them")
    if DRAFTER_FP8_RECIPE not in fp8.RECIPES:
        errs.append(f"DRAFTER_FP8_RECIPE={DRAFTER_FP8_RECIPE!r}: allowed are {', '.join(fp8.RECIPES)}")
    if COMPILE_DRAFTER not in COMPILE_MODES:
        errs.append(f"COMPILE_DRAFTER={COMPILE_DRAFTER!r}: allowed are {', '.join(COMPILE_MODES)}")
    if EVAL_DTYPE not in ("float32", "bfloat16"):
        errs.append(f"EVAL_DTYPE={EVAL_DTYPE!r}: allowed are float32, bfloat16")
    if EVAL_EVERY and not Path(EVAL_PROMPTS or REPO / "data" / "default" / "eval_prompts.jsonl").exists():
        errs.append(f"EVAL_PROMPTS={EVAL_PROMPTS!r} does not exist (a JSONL of prompts, see eval_dflash.py)")
    if not Path(DATA).is_dir():
        errs.append(f"DATA={DATA} is not a folder: prepare one with `python -m data.prepare --tokenizer "
                    f"{TARGET} --out DIR INPUT.jsonl`")
    if errs:
        sys.exit("error: bad configuration:\n  - " + "\n  - ".join(errs))


# --- warm start (INIT_FROM) -----------------------------------------------------------------------------------------

# The drafter fields that make an export fit this run, each with the setting that decides it here ("TARGET": it
# comes from the target's config). Exports differing in any of these are refused before any model loads.
INIT_FROM_FIELDS = [
    ("num_hidden_layers", "NUM_DRAFT_LAYERS"), ("block_size", "BLOCK_SIZE"), ("target_layer_ids", "TARGET_LAYER_IDS"),
    ("mask_token_id", "MASK_TOKEN_ID"), ("layer_types", "SLIDING_WINDOW_LAYERS"), ("sliding_window", "SLIDING_WINDOW"),
    ("hidden_size", "TARGET"), ("num_attention_heads", "TARGET"), ("num_key_value_heads", "TARGET"),
    ("head_dim", "TARGET"), ("intermediate_size", "TARGET"), ("vocab_size", "TARGET"), ("num_target_layers", "TARGET"),
    ("attention_bias", "TARGET"),
]


def check_init_from(dcfg) -> list[str]:
    """INIT_FROM's config.json against the drafter this run builds (dcfg), before any model loads. Exits naming
    every setting that differs, both values and the flag that fits the export; returns notes on fields that are
    not shapes (RoPE, norm eps, context length), which the run takes from its target."""
    cfg = json.loads((Path(INIT_FROM) / "config.json").read_text())
    if not isinstance(cfg, dict) or "dflash_config" not in cfg or "num_target_layers" not in cfg:
        sys.exit(f"error: INIT_FROM={INIT_FROM} is not an exported drafter (its config.json has no dflash_config / "
                 f"num_target_layers: a target or other HF model folder?). INIT_FROM takes a drafter this trainer "
                 f"exported, e.g. runs/x/checkpoints/step_N/drafter; the target goes in TARGET")
    src = DrafterConfig.from_serving(cfg)

    def as_setting(key, cfg):   # the field as the value of the setting that decides it
        v = getattr(cfg, key)
        return {"target_layer_ids": lambda: ",".join(map(str, v)),
                "layer_types": lambda: v.count("sliding_attention"), "sliding_window": lambda: v or 0}.get(key,
                                                                                                    lambda: v)()
    errs, of_target = [], []
    for key, setting in INIT_FROM_FIELDS:
        ours, theirs = as_setting(key, dcfg), as_setting(key, src)
        if ours == theirs:
            continue
        if setting == "TARGET":
            of_target.append((key, ours, theirs))
        else:
            errs.append(f"{setting}: this run has {ours} ({key}), the drafter in INIT_FROM {theirs}: pass "
                        f"--{setting}={theirs}")
    if of_target:
        errs.append(f"the target (TARGET={TARGET}) has " + ", ".join(f"{f}={o}" for f, o, _ in of_target)
                    + "; the drafter in INIT_FROM was made for " + ", ".join(f"{f}={t}" for f, _, t in of_target)
                    + ": it was trained for another target")
    if errs:
        sys.exit(f"error: INIT_FROM={INIT_FROM} does not fit this run's drafter:\n  - " + "\n  - ".join(errs))
    return [f"NOTE: INIT_FROM has {f}={getattr(src, f)}, this run uses its target's {getattr(dcfg, f)}"
            for f in ("rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings")
            if getattr(src, f) != getattr(dcfg, f)]


def load_init_from(drafter) -> str:
    """The INIT_FROM export's weights into the run's drafter, whose fp32 master weights take them in whatever dtype
    the export was written (fp32 exactly; bf16 widened exactly). Returns that dtype."""
    state = load_file(str(Path(INIT_FROM) / "model.safetensors"), device=str(next(drafter.parameters()).device))
    missing = drafter.state_dict().keys() - state.keys()
    extra = state.keys() - drafter.state_dict().keys()
    if missing or extra:
        sys.exit(f"error: INIT_FROM={INIT_FROM}: model.safetensors does not hold this drafter's parameters (missing "
                 f"{sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}); export it with model.export.export_drafter")
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in state.values()})
    drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return "/".join(dtypes)


def eval_inputs(tok, stats: dict) -> dict:
    """EVAL_EVERY's prompts, checked at start-up (a bad row used to end the job at its first evaluation), and the
    dataset's thinking mode (data.prepare's stats.json), so the drafter is measured on prompts rendered as it was
    trained. tok: TARGET's tokenizer or None. -> {prompts, enable_thinking, path, tok}."""
    path = Path(EVAL_PROMPTS or REPO / "data" / "default" / "eval_prompts.jsonl")
    try:
        prompts = eval_dflash.load_prompts(path, limit=EVAL_LIMIT)
        for row in prompts:
            if "input_ids" not in row:
                eval_dflash.prompt_messages(row)
                if tok is None:
                    raise ValueError(f"prompt {row['id']!r} is text, and TARGET={TARGET} has no tokenizer to encode "
                                     f"it: give its rows as input_ids")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        sys.exit(f"error: EVAL_PROMPTS={path}: {type(e).__name__ + ': ' if not isinstance(e, ValueError) else ''}{e}")
    if not prompts:
        sys.exit(f"error: EVAL_PROMPTS={path} holds no prompts (a JSONL of prompts, see eval_dflash.py)")
    thinking = stats.get("thinking")
    return {"prompts": prompts, "path": path, "enable_thinking": {"on": True, "off": False}.get(thinking), "tok": tok}


# --- distributed setup --------------------------------------------------------------------------------------------

class Dist:
    """Who this process is. One process (no torchrun) = target and drafter in turn, no transport."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        check_config(self.world)
        self.colocated = self.world == 1
        self.n_targets = 1 if self.colocated else TARGET_RANKS
        self.n_drafters = 1 if self.colocated else self.world - TARGET_RANKS
        self.is_target = self.colocated or self.rank < TARGET_RANKS
        self.is_drafter = self.colocated or self.rank >= TARGET_RANKS
        self.is_master = self.colocated or self.rank == TARGET_RANKS          # first drafter: logs and saves
        self.drafter_index = 0 if self.colocated else self.rank - TARGET_RANKS
        # target replicas: ranks [i*N, (i+1)*N) share one sharded target (TARGET_SHARDS = N)
        self.shards = 1 if self.colocated else TARGET_SHARDS
        self.n_replicas = self.n_targets // self.shards
        first = self.rank // self.shards * self.shards
        self.replica_ranks = range(first, first + self.shards) if self.is_target else range(0)
        self.roles = ["target" if r < self.n_targets else "drafter" for r in range(self.world)]
        self.role = "target+drafter" if self.colocated else self.roles[self.rank]
        use_cuda = DEVICE == "cuda" or (DEVICE == "auto" and torch.cuda.is_available())
        if use_cuda:
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))   # ranks share the CPU
        self.dtype = {"auto": torch.bfloat16 if use_cuda else torch.float32, "bfloat16": torch.bfloat16,
                      "float32": torch.float32}[DTYPE]
        self.flex = ATTN == "flex" or (ATTN == "auto" and use_cuda)
        self.ctrl = self.data = self.drafters = self.store = None
        self.shard_group = self.shard_ctrl = None   # a sharded target's replica: FSDP's group, pipe.Replica's (gloo)
        if not self.colocated:
            backend = "nccl" if use_cuda else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=max(1800.0, STALL_TIMEOUT)),
                                    device_id=self.device if use_cuda else None)
            assert dist.get_world_size() == self.world
            self.data = dist.group.WORLD                                        # features: NCCL on GPU
            self.ctrl = dist.new_group(backend="gloo")                          # headers and token ids: CPU
            self.drafters = dist.new_group(list(range(self.n_targets, self.world)))  # DDP among drafters only
            for i in range(self.n_replicas if self.shards > 1 else 0):          # every rank makes every group
                ranks = list(range(i * self.shards, (i + 1) * self.shards))
                group, ctrl = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
                if self.rank in ranks:
                    self.shard_group, self.shard_ctrl = group, ctrl
            self.store = dist.distributed_c10d._get_default_store()

    def __str__(self):
        shard = f", target replica {self.rank // self.shards} shard {self.rank % self.shards + 1}/{self.shards}" \
            if self.shards > 1 and self.is_target else ""
        return (f"rank {self.rank}/{self.world} {self.role} on {self.device} ({self.dtype}, "
                f"attention={'flex' if self.flex else 'sdpa'}) pid {os.getpid()}{shard}")


def log(msg: str) -> None:
    sys.stdout.write(msg + "\n")   # one write: ranks sharing a terminal never interleave inside a line
    sys.stdout.flush()


class Phase:
    """Prints a start-up phase as it begins and ends, so a user polling tmux knows where the job is."""

    def __init__(self, d, name, watchdog=None):
        self.d, self.name, self.watchdog = d, name, watchdog

    def __enter__(self):
        self.t = time.time()
        if self.watchdog:
            self.watchdog.state = self.name
        log(f"[rank {self.d.rank} {self.d.role}] {self.name} ...")

    def __exit__(self, *exc):
        if exc[0] is None:
            log(f"[rank {self.d.rank} {self.d.role}] {self.name} done ({time.time() - self.t:.1f}s)")


# --- one drafter step (the trainer's and the bench's) -----------------------------------------------------------------

def mask_lengths(cfg, device, flex):
    """The flex masks' fixed (Q_LEN, KV_LEN) on a GPU: MAX_ANCHORS blocks against TOKEN_BUDGET context rows, so
    flex_attention compiles once, for static shapes. None (each mask its own length) for the CPU's masks."""
    if not flex or torch.device(device).type != "cuda":
        return None
    return static_lengths(MAX_ANCHORS, cfg.block_size, TOKEN_BUDGET)


def make_prepare(cfg, device, flex):
    """Packet -> Prepared (model.objective.prepare) with this run's objective settings."""
    return functools.partial(prepare, cfg=cfg, seed=SEED, max_anchors=MAX_ANCHORS, min_per_doc=MIN_ANCHORS_PER_DOC,
                             gamma=GAMMA, flex=flex, device=device, lengths=mask_lengths(cfg, device, flex))


def loss_reweight(item, block_size):
    """LOSS_WEIGHTING=dpace: D-PACE's weights, which weighted_ce makes from the drafter's own predictions (detached)
    after its chunks; exp: None, the decay make_blocks wrote into item.weights is the weighting. Either way the
    gradients hold sum(w * CE) and the step divides them by the global sum of the same w."""
    return dpace_reweight(item.weights, item.rows, block_size, DPACE_ALPHA) if LOSS_WEIGHTING == "dpace" else None


def decay_weighted(parts, item):
    """(sum w * CE, sum w) under the exp decay of item.weights whatever LOSS_WEIGHTING is: the status line's loss,
    so runs with either weighting read on one scale."""
    if LOSS_WEIGHTING == "exp":
        return parts.loss_sum.detach(), parts.weight_sum
    w = item.weights.index_select(0, item.rows)                                              # [R]
    return (w * parts.ce).sum(), w.sum()


def drafter_step(model, embed, head_w, item, block_size, autocast, sync=True, probe=None, saved_hooks=None):
    """One micro-batch's forward, loss and backward: the gradients accumulate sum(w * CE) until optimizer_step.
    sync=False: a DDP model skips its gradient all-reduce (not the step's last micro-batch). probe(phase) and
    saved_hooks: the bench's instruments. -> [8] float64 sums: exp-decay loss, its weight, acc_num, acc_den,
    streak_num, streak_den, objective loss, its weight (index 7: the step's normaliser)."""
    probe = probe or (lambda phase: None)
    feats = item.features                                                                    # [T, K*H]
    if NOISE:
        gen = torch.Generator(device=feats.device).manual_seed(micro_seed(SEED, item.g))
        feats = feats + (torch.rand(feats.shape, generator=gen, device=feats.device, dtype=torch.float32)
                         * 2 - 1).mul_(NOISE).to(feats.dtype)
    no_sync = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):   # FSDP2: reduce-scatter only after the step's last micro-batch
        model.set_requires_gradient_sync(sync)
    with no_sync, autocast:
        with saved_hooks or contextlib.nullcontext():
            hidden = model(feats, item.ctx_pos, embed(item.block_ids), item.block_pos, item.attn)   # [N*B, H]
            probe("forward")
            parts = weighted_ce(hidden, head_w, item.labels, item.weights, CE_CHUNK, rows=item.rows,
                                reweight=loss_reweight(item, block_size))
            probe("CE")
        parts.loss_sum.backward()
    probe("backward")
    bm = block_metrics(parts.correct.view(-1, block_size), item.weights.view(-1, block_size))
    return torch.stack([*decay_weighted(parts, item), bm["acc_num"], bm["acc_den"], bm["streak_num"],
                        bm["streak_den"], parts.loss_sum.detach(), parts.weight_sum]).double()


def optimizer_step(params, opt, step_w, n_drafters=1, group=None):
    """The update after a step's micro-batches. Global normalisation: the gradients hold sum(w * CE) (averaged over
    the n_drafters ranks of `group` by DDP's all-reduce, or FSDP2's reduce-scatter, which averages the same way),
    step_w [1] this rank's sum of w: divide by the global one."""
    if n_drafters > 1:
        dist.all_reduce(step_w, group=group)
    scale_clip_(params, (n_drafters / step_w.clamp(min=1e-12)).float(), GRAD_CLIP, opt)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_w.zero_()


def autocast_for(device, dtype):
    return torch.autocast("cuda", dtype=dtype) if device.type == "cuda" and dtype != torch.float32 \
        else torch.autocast("cpu", enabled=False)


# --- logging ----------------------------------------------------------------------------------------------------------

def fmt_eta(s):
    if not math.isfinite(s):
        return "?"
    return f"{s / 86400:.1f}d" if s >= 86400 else f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m" if s >= 60 \
        else f"{s:.0f}s"


def fmt_q_pre(q_pre, shards):
    """The target ranks' q_pre depths, a sharded target's replicas set apart: [3, 2 | 0, 1]."""
    return "[" + " | ".join(", ".join(map(str, q_pre[i:i + shards])) for i in range(0, len(q_pre), shards)) + "]"


def fmt_k(x):
    return f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


class Metrics:
    """metrics.jsonl (+ optional TensorBoard / W&B) on the master."""

    def __init__(self, out_dir, config):
        self.f = open(out_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = self.wandb = None
        if TENSORBOARD:
            from torch.utils.tensorboard import SummaryWriter   # optional package
            self.tb = SummaryWriter(str(out_dir / "tb"))
        if WANDB_PROJECT:
            import wandb   # optional package
            self.wandb = wandb.init(project=WANDB_PROJECT, config=config, dir=str(out_dir))

    def write(self, row):
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
        nums = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, row["step"])
        if self.wandb:
            self.wandb.log(nums, step=row["step"])

    def flush(self):
        self.f.flush()


def split_min_tokens() -> int:
    """Busy tokens a rank's clock must hold before its rate counts for the split report: ~2.5 micro-batches."""
    return 5 * TOKEN_BUDGET // 2


def measured_enough(clock: dict) -> bool:
    """A peer's heartbeat carries a BusyClock with enough work for a rate."""
    return bool(clock) and clock.get("busy_tok", 0) >= split_min_tokens() and clock.get("busy_s", 0) > 0


def report_split(peers, d, row) -> bool:
    """Once every rank has computed a few micro-batches: each role's measured capacity (tokens per busy second per
    GPU) and the split planner.recommend_split gives for this many GPUs. Returns whether it could report."""
    rates = {}
    for r, info in peers.items():
        if not measured_enough(info):
            return False
        rates.setdefault(d.roles[r], []).append(info["busy_tok"] / info["busy_s"])
    tgt, dft = (sum(v) / len(v) for v in (rates["target"], rates["drafter"]))
    best = planner.recommend_split(tgt, dft, d.world, d.shards)
    row.update(target_capacity_tok_s=tgt, drafter_capacity_tok_s=dft, recommended_split=list(best))
    advice = "keep it" if best == (d.n_targets, d.n_drafters) else f"try --TARGET_RANKS={best[0]} (resume keeps " \
                                                                   f"the data position)"
    log(f"throughput per GPU (measured while busy): target {fmt_k(tgt)}tok/s, drafter {fmt_k(dft)}tok/s -> for "
        f"{d.world} GPUs the planner recommends {best[0]} targets : {best[1]} drafters (now {d.n_targets} : "
        f"{d.n_drafters}; {advice})")
    return True


def log_peak_memory(d):
    """A GPU rank's peak memory over the run, to read against the planner's estimate printed at the start."""
    if d.device.type == "cuda":
        gib = 2 ** 30
        peak = torch.cuda.max_memory_allocated(d.device)
        est = getattr(d, "mem_estimate", None)
        vs = f" (planner estimate {est / gib:.2f} GiB, estimate/measured {est / max(peak, 1):.3f})" if est else ""
        log(f"[rank {d.rank} {d.role}] peak GPU memory: {peak / gib:.2f} GiB allocated{vs}, "
            f"{torch.cuda.max_memory_reserved(d.device) / gib:.2f} GiB reserved by the caching allocator")


def finish(d, watchdog, code):
    sys.stdout.flush()
    sys.stderr.flush()
    if d.colocated:
        sys.exit(code)
    if d.is_master:
        watchdog.finished()   # tells every rank to exit, waits for them, exits 0
    wait_done(d, watchdog)


def wait_done(d, watchdog):
    """Non-master ranks idle here until the master has saved; their watchdog then exits them with code 0."""
    watchdog.state = "finished; waiting for the master's last checkpoint"
    while True:
        time.sleep(1)


# --- main: the job's phases -------------------------------------------------------------------------------------------

def fail(watchdog, reason, detail=""):
    """End the job (every rank, through the watchdog) with one line saying why."""
    if watchdog:
        watchdog.fail(reason, detail)
    print(detail, file=sys.stderr)
    sys.exit(f"error: {reason}")


def on_signals(d, watchdog, ck_root) -> threading.Event:
    """SIGTERM / SIGINT set the returned flag, acted on at the next optimizer step boundary; a second one ends now."""
    stop_flag = threading.Event()
    first_signal = []   # when the first one came

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        # the second one ends the job: the next step may never come (a stuck rank, a wait on input). One Ctrl-C
        # reaches a rank twice, from the terminal and forwarded by torchrun a moment later: that is still the first.
        if first_signal and time.monotonic() - first_signal[0] > SECOND_SIGNAL_S:
            fail(watchdog, f"got a second {name}: ending now, without a checkpoint; RESUME=auto continues from the "
                           f"newest complete one in {ck_root}")
        if first_signal:
            return
        first_signal.append(time.monotonic())
        stop_flag.set()
        log(f"[rank {d.rank} {d.role}] got {name}: saving a checkpoint at the next step (send it again to end now)")
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop_flag


def choose_mask_token_id(tok, vocab_rows) -> int:
    """MASK_TOKEN_ID, or the first unused id when it is -1, checked against the target's tokenizer."""
    mask_id = MASK_TOKEN_ID
    if mask_id < 0:
        if tok is None:
            sys.exit(f"error: TARGET={TARGET} has no tokenizer, so MASK_TOKEN_ID cannot be chosen: pass "
                     f"--MASK_TOKEN_ID=<an unused id below {vocab_rows}>")
        return default_mask_token_id(tok, vocab_rows)
    if tok is not None:
        try:
            check_mask_token_id(mask_id, tok, vocab_rows)
        except ValueError as e:
            sys.exit(f"error: --MASK_TOKEN_ID={mask_id}: {e}. Leave --MASK_TOKEN_ID=-1 to use "
                     f"{default_mask_token_id(tok, vocab_rows)}, chosen automatically")
    elif not 0 <= mask_id < vocab_rows:
        sys.exit(f"error: MASK_TOKEN_ID={mask_id} is outside the target's embedding (0..{vocab_rows - 1})")
    return mask_id


def drafter_config(d, config):
    """What needs the target's config and tokenizer (no weights yet): the data's tokenizer check, the evaluation's
    prompts, the MASK id, the DrafterConfig. Fills MASK_TOKEN_ID and TARGET_LAYER_IDS into config.
    -> (dcfg, hf_cfg, eval_setup or None)."""
    hf_cfg = AutoConfig.from_pretrained(TARGET, local_files_only=True).get_text_config()
    try:
        tok = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    except (OSError, ValueError):
        tok = None
    try:
        stats = read_stats(DATA)
    except DataError as e:
        sys.exit(f"error: {e}")
    if tok is not None and stats:
        errs = tokenizer_mismatches(stats, tok, DATA, TARGET)
        if errs:
            sys.exit("error: DATA does not match TARGET:\n  - " + "\n  - ".join(errs))
    elif d.is_master and stats.get("tokenizer_hash"):
        log(f"NOTE: TARGET={TARGET} has no tokenizer: DATA's tokenizer ({stats.get('tokenizer')}) is not checked")
    eval_setup = eval_inputs(tok, stats) if EVAL_EVERY else None
    if eval_setup and d.is_master:
        log(f"eval: every {EVAL_EVERY} checkpoint(s), {len(eval_setup['prompts'])} prompts of {eval_setup['path']}, "
            f"thinking={stats.get('thinking') or 'the template default'} (as DATA was prepared)")
    mask_id = choose_mask_token_id(tok, hf_cfg.vocab_size)
    layer_ids = [int(x) for x in TARGET_LAYER_IDS.split(",")] if TARGET_LAYER_IDS else None
    try:
        dcfg = DrafterConfig.from_target(hf_cfg, NUM_DRAFT_LAYERS, BLOCK_SIZE, mask_id, target_layer_ids=layer_ids,
                                         num_taps=NUM_TAPS or None, sliding_window_layers=SLIDING_WINDOW_LAYERS,
                                         sliding_window=SLIDING_WINDOW or None)
    except AssertionError as e:
        sys.exit(f"error: drafter config: {e}")
    config.update(MASK_TOKEN_ID=mask_id, TARGET_LAYER_IDS=",".join(map(str, dcfg.target_layer_ids)))
    return dcfg, hf_cfg, eval_setup


def load_data(d, config, hf_cfg, watchdog):
    """The dataset and its batch plan; on a GPU also the memory plan per role, refusing what cannot fit."""
    with Phase(d, "load data", watchdog):
        try:
            data = Data(DATA, hf_cfg.vocab_size, TOKEN_BUDGET, MAX_BATCH_SIZE, seed=SEED)
        except DataError as e:
            sys.exit(f"error: {e}")
    if d.device.type == "cuda":
        gpu_mem = torch.cuda.get_device_properties(d.device).total_memory
        mplan = planner.estimate({**config, "MAX_LEN": int(max(data.plan.lengths))}, hf_cfg, d.world, gpu_mem)
        if d.is_master:
            log(planner.format_plan(mplan))
        d.mem_estimate = mplan["roles"][d.role]["total"]                  # read back by log_peak_memory
        errs = planner.check_fits(mplan, gpu_mem)
        if errs:
            sys.exit("error: the config does not fit this GPU (planner.py):\n  - " + "\n  - ".join(errs))
    return data


def choose_resume(d, watchdog, out_dir, ck_root):
    """The checkpoint to resume (or None): chosen by the master, which also takes OUT_DIR's lock, and shared with
    every rank through the store."""
    if d.is_master and not DRY_RUN:   # one job per OUT_DIR, from here to the process's exit
        try:
            ckpt.lock_out_dir(out_dir, log=log)
        except ckpt.CheckpointError as e:
            fail(watchdog, str(e))
    if not d.is_master:
        return (d.store.get("resume_path").decode() or None) if d.store else None
    resume_path = None
    existing = ckpt.list_checkpoints(ck_root)
    if RESUME == "scratch" and existing:
        fail(watchdog, f"RESUME=scratch but {ck_root} already holds checkpoints ({existing[-1].name}); nothing was "
                       f"overwritten. Use RESUME=auto to continue, or another OUT_DIR")
    elif RESUME == "auto":
        resume_path = ckpt.latest_complete(ck_root, log=log)
        if existing and resume_path is None:
            log(f"WARNING: no complete checkpoint among {len(existing)} in {ck_root}: starting from scratch")
    elif RESUME != "scratch":
        try:
            ckpt.verify(RESUME)
        except ckpt.CheckpointError as e:
            fail(watchdog, f"RESUME={RESUME}: {e}")
        resume_path = Path(RESUME)
    if d.store:
        d.store.set("resume_path", str(resume_path or ""))
    return resume_path


def resume(d, watchdog, resume_path, config, data, dcfg, fingerprint) -> ckpt.ResumePoint:
    """Where this run starts: the checkpoint's point (checkpoint.resume_point), after refusing a checkpoint trained
    for another drafter shape or target."""
    meta = ckpt.read_meta(resume_path) if resume_path else None
    if meta:
        errs = ckpt.resume_mismatches(meta, dcfg, fingerprint)
        if errs:
            fail(watchdog, f"cannot resume {resume_path}: this run differs in what the checkpoint was trained for:\n"
                           f"  - " + "\n  - ".join(errs) + "\nResume with the checkpoint's settings and TARGET, or "
                           f"start over in another OUT_DIR")
        if d.is_master and not meta.get("target"):
            log(f"WARNING: {resume_path} records no target fingerprint (written by an older version): the TARGET "
                f"is not checked against it")
        elif d.is_master and meta["target"]["path"] != fingerprint["path"]:
            log(f"NOTE: TARGET moved since the checkpoint ({meta['target']['path']} -> {fingerprint['path']}); "
                f"same config and weights")
    rp = ckpt.resume_point(meta, data, config)
    if d.is_master:
        for note in rp.notes:
            log(note)
    if rp.error:
        fail(watchdog, f"cannot resume {resume_path}: {rp.error}")
    if meta and d.is_master:
        for note in ckpt.environment_notes(meta, [d.n_targets, d.n_drafters], rp.start_g):
            log(note)
    return rp


def log_plan(d, config, data, sched, dcfg, step, total_steps, resume_path, init_notes):
    log("config: " + " ".join(f"{k}={v}" for k, v in config.items()))   # the final values, in every log
    ps = data.plan.stats()
    log(f"data: {data.num_rows:,} rows, {len(data.rows):,} trainable"
        + (f" (dropped {data.dropped})" if data.dropped else "")
        + f"; {data.plan.num_batches:,} micro-batches/epoch (mean {ps['mean_batch_size']:.1f} seqs, "
          f"padding waste {ps['padding_waste']:.1%})")
    replicas = f" ({d.n_replicas} target replica{'s' if d.n_replicas > 1 else ''} x TARGET_SHARDS={d.shards}, " \
        f"each rank forwarding its own micro-batches)" if d.shards > 1 else ""
    log(f"plan: {d.n_targets} target : {d.n_drafters} drafter ranks{replicas} x GRAD_ACCUM={GRAD_ACCUM} => "
        f"{sched.per_step} micro-batches/step; {total_steps:,} steps ({sched.total_g:,} micro-batches, "
        f"{sched.total_g / data.plan.num_batches:.2f} epochs); drafter L={dcfg.num_hidden_layers} "
        f"taps={dcfg.target_layer_ids} B={dcfg.block_size} mask_token_id={dcfg.mask_token_id}")
    if resume_path:
        log(f"RESUMING from step {step} of {resume_path} (micro-batch {sched.g0}, "
            f"epoch~{sched.g0 / data.plan.num_batches:.2f})")
        if INIT_FROM:
            log(f"NOTE: INIT_FROM={INIT_FROM} is ignored: a checkpoint to resume wins (RESUME={RESUME}); "
                f"use another OUT_DIR to start over from INIT_FROM")
    elif INIT_FROM:
        for note in init_notes:
            log(note)
    if "GAMMA" in _GIVEN and LOSS_WEIGHTING == "dpace":
        log(f"NOTE: GAMMA={GAMMA} is not used: LOSS_WEIGHTING=dpace weighs a block's slots by the drafter's own "
            f"confidence (DPACE_ALPHA is its setting); GAMMA is the decay of LOSS_WEIGHTING=exp")


def write_run_info(d, out_dir, config, data, dcfg, fingerprint, resume_path):
    out_dir.mkdir(parents=True, exist_ok=True)
    run_info = {"config": config, "env": ckpt.environment(), "world": d.world, "split": [d.n_targets, d.n_drafters],
                "drafter": dcfg.__dict__, "data": {"rows": data.num_rows, "trainable": len(data.rows),
                                                   "dropped": data.dropped, "content_hash": data.content_hash,
                                                   "num_batches": data.plan.num_batches},
                "target": fingerprint, "resumed_from": str(resume_path) if resume_path else None, "time": time.time()}
    (out_dir / "run.json").write_text(json.dumps(run_info, indent=1, default=str))


def load_target(d, dcfg, watchdog):
    """The frozen target of a target rank (or the one process): FP8 and compiled as configured."""
    sharded = f" (1/{d.shards} of layers 0..{max(dcfg.target_layer_ids)} per rank, FSDP2)" if d.shards > 1 else ""
    with Phase(d, f"load target {TARGET}{sharded}", watchdog):
        target = Target(TARGET, d.device, d.dtype, dcfg.target_layer_ids, shard_group=d.shard_group)
    if target.sharded:
        params = list(target.decoder.parameters())
        held, whole = sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)
        log(f"[rank {d.rank} {d.role}] holds {held:,} of the {whole:,} target parameters it runs "
            f"({held / whole:.1%}; replica {d.rank // d.shards} = ranks {d.replica_ranks[0]}..{d.replica_ranks[-1]})")
    if TARGET_FP8:   # before compiling: the compiled layers then fuse the activations' FP8 casts
        log(f"[rank {d.rank} {d.role}] TARGET_FP8: {fp8.quantize_target(target)} Linear layers of target "
            f"layers 0..{max(dcfg.target_layer_ids)} in FP8 (per-row scales)")
    if COMPILE_TARGET:
        target.compile_layers()   # compiled at its first forward, on the main thread (the one process's too)
    return target


def run_target(d, data, sched, target, watchdog):
    """A target rank's whole job: its micro-batches through the target and out to their drafters; never returns."""
    sender = Sender(d.ctrl, d.data, SEND_DEPTH, watchdog)
    sender.start()
    clock = BusyClock(d.device)
    watchdog.collect.append(clock.poll)
    watchdog.steady = True
    watchdog.state = "producing"
    n0 = 0
    replica = Replica(d.shard_ctrl, [sched.target_gs(r) for r in d.replica_ranks], d.rank % d.shards) \
        if d.shards > 1 else None
    for p in produce(data, sched.target_gs(d.rank), target, d.device, Q_PREFETCH, StopPoint(d.store, sched.total_g),
                     watchdog, clock, replica=replica):
        sender.put(d.n_targets + sched.consumer(p.g), p)
        watchdog.progress()
        n0 += 1
        watchdog.stats.update(n=n0, tok=sender.tokens, q=watchdog.stats.get("q", 0))
    watchdog.state = "all micro-batches produced; waiting for the drafters to finish"
    log_peak_memory(d)
    wait_done(d, watchdog)


def build_drafter(d, dcfg, target, resume_path, watchdog):
    """fp32 master weights (from the checkpoint, INIT_FROM or SEED), the frozen embedding / lm_head, the optimizer;
    compiled, and wrapped in DDP or sharded with FSDP2 (DRAFTER_SHARDING) as configured.
    -> (drafter, model, opt, embed, head_w)."""
    sharded = DRAFTER_SHARDING == "fsdp"
    with Phase(d, "build drafter", watchdog):
        torch.manual_seed(SEED)
        drafter = Drafter(dcfg).to(d.device)                      # fp32 master weights
        if DRAFTER_FP8:   # the same parameters in other modules: before the optimizer and the compile
            n = fp8.convert_drafter(drafter, recipe=DRAFTER_FP8_RECIPE)
            log(f"[rank {d.rank} {d.role}] DRAFTER_FP8: {n} Linear layers train in FP8 ({DRAFTER_FP8_RECIPE}); fc "
                f"and the lm_head stay bf16" + ("" if COMPILE_DRAFTER == "layers" else
                                                "; meant with COMPILE_DRAFTER=layers, which fuses its casts"))
        # not sharded: frozen, outside the optimizer, so sharding would save only their bf16 copy, for an all-gather
        # of [V, H] every micro-batch
        embed, head_w, _ = load_frozen_io(TARGET, d.device, d.dtype) if target is None else \
            (target.embed_tokens, target.lm_head_weight, None)
        if HEAD_FP8:   # quantised once; the bf16 weight stays inside it for the rest
            head_w = fp8.HeadFP8(head_w)
            log(f"[rank {d.rank} {d.role}] HEAD_FP8: the loss's lm_head GEMMs in FP8 ([{head_w.weight.shape[0]}, "
                f"{head_w.weight.shape[1]}] quantised per row and per column, "
                f"{2 * head_w.weight.numel() / 2 ** 30:.2f} GiB)")
        if INIT_FROM and not resume_path:
            dtype = load_init_from(drafter)
            if d.is_master:
                log(f"INIT_FROM: drafter weights from {INIT_FROM} ({dtype} export, into float32 master weights); "
                    f"a fresh run: step 0, new optimizer, the LR schedule from its start")
        if COMPILE_DRAFTER != "off":
            compile_drafter(drafter, COMPILE_DRAFTER)   # compiled by the first step, on this (the main) thread
        if sharded:                                     # replaces the parameters: before the optimizer is made
            shard_drafter(d, drafter)
        # the overlapped step would race FSDP2's all-gather of the root's parameters (fc, norms), which runs before
        # the forward's first params_ready wait; sharded, the step is 1/D of the work anyway
        opt = make_optimizer(drafter, LR, WEIGHT_DECAY, overlap=OVERLAP_OPTIMIZER and not sharded)
        if sharded and OVERLAP_OPTIMIZER and d.is_master and d.device.type == "cuda":
            log("NOTE: DRAFTER_SHARDING=fsdp: the optimizer step runs in line (OVERLAP_OPTIMIZER is for ddp)")
        if resume_path:
            restore_drafter(d, dcfg, resume_path, drafter, opt)
        model = drafter
        if d.n_drafters > 1 and not sharded:
            model = DDP(drafter, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                        process_group=d.drafters)
    if d.flex:
        set_flex_kernel_options(json.loads(FLEX_OPTIONS) if FLEX_OPTIONS else None)
        with Phase(d, "compile flex_attention (main thread, before worker threads)", watchdog):
            warmup_flex_attention(d.device, d.dtype, dcfg.num_attention_heads, dcfg.num_key_value_heads,
                                  dcfg.head_dim, dcfg.block_size, mask_lengths(dcfg, d.device, d.flex))
    return drafter, model, opt, embed, head_w


def shard_drafter(d, drafter) -> None:
    """DRAFTER_SHARDING=fsdp: FSDP2 over the drafter ranks, one unit per decoder layer and the root (fc, hidden_norm,
    norm), so each rank keeps 1/D of the fp32 weights, gradients and AdamW state. On a GPU the forward runs on bf16
    all-gathered weights (DTYPE); gradients are reduce-scattered in fp32. cast_forward_inputs off: the activations
    keep the dtypes the drafter's code gives them (fp32 RoPE tables, norms), as under DDP and autocast."""
    mesh = DeviceMesh.from_group(d.drafters, d.device.type)
    mp = MixedPrecisionPolicy(param_dtype=d.dtype if d.device.type == "cuda" else None, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(drafter, mesh=mesh, mp_policy=mp)


def restore_drafter(d, dcfg, resume_path, drafter, opt) -> None:
    """A checkpoint's weights, optimizer and RNG into this run's drafter, whatever wrote it: a sharded checkpoint
    (DCP) onto any number of drafter ranks, sharded or whole; a DDP checkpoint's state.pt whole, or into the
    shards through a whole copy on the CPU."""
    try:
        if ckpt.is_sharded(resume_path):
            state = ckpt.load_shards(resume_path, drafter, opt, d.drafters)
        else:
            state = ckpt.load_state(resume_path, map_location=d.device if DRAFTER_SHARDING == "ddp" else "cpu")
            if DRAFTER_SHARDING == "ddp":
                drafter.load_state_dict(state["drafter"])
                opt.load_state_dict(state["optimizer"])
            else:
                plain = Drafter(dcfg)
                plain_opt = make_optimizer(plain, LR, WEIGHT_DECAY)
                plain.load_state_dict(state["drafter"])
                plain_opt.load_state_dict(state["optimizer"])
                ckpt.load_full_into_sharded(drafter, opt, plain, plain_opt)
    except ValueError as e:
        raise SystemExit(f"error: the optimizer state in {resume_path} does not match this drafter's "
                         f"parameters ({e}); it was written for another drafter shape "
                         f"(NUM_DRAFT_LAYERS, TARGET_LAYER_IDS or the target). Resume with the settings "
                         f"that wrote it, or start over in another OUT_DIR") from e
    ckpt.restore_rng(state)


def start_feed(d, data, sched, target, dcfg, watchdog, pre_stats):
    """The drafter side's Prefetcher: prepared micro-batches Q_HS ahead, from the network (a drafter rank) or from the
    target forward (the one process; its q_pre depth goes to pre_stats). The one process runs an eager target on
    the feeder thread, which launches its kernels beside the main thread's (a small target is launch-bound), and a
    compiled one on the main thread a micro-batch ahead (TargetAhead: compiled code must not run on one thread while
    another compiles)."""
    if d.colocated:
        packets = produce(data, sched.target_gs(0), target, d.device, Q_PREFETCH, stats=pre_stats)
        if COMPILE_TARGET:
            log(f"[rank {d.rank} {d.role}] COMPILE_TARGET: the target forward runs on the main thread, a micro-batch "
                f"ahead of the step; the feeder thread prepares")
            feed = TargetAhead(packets, make_prepare(dcfg, d.device, d.flex), d.device, Q_HS)
        else:
            feed = Prefetcher(packets, make_prepare(dcfg, d.device, d.flex), d.device, Q_HS, name="feeder")
    else:
        schedule = ((g, sched.producer(g)) for g in sched.drafter_gs(d.drafter_index))
        packets = receive(schedule, d.ctrl, d.data, d.device, watchdog)
        feed = Prefetcher(packets, make_prepare(dcfg, d.device, d.flex), d.device, Q_HS, name="receiver",
                          fail=watchdog.fail)
        watchdog.state = "waiting for the first micro-batch (queues filling)"
    feed.start()
    return feed


def main(argv):
    config = parse_overrides(argv)
    resolve_paths()
    config.update(TARGET=TARGET, DATA=DATA)
    d = Dist()
    log(f"[rank {d.rank} {d.role}] {d}")
    errs = [e for name in ("TARGET_FP8", "DRAFTER_FP8", "HEAD_FP8") if globals()[name] and
            (e := fp8.check(name, d.device))]
    if errs:   # every rank checks, so the whole job stops here, before any model loads
        sys.exit("error: " + "; ".join(errs))
    out_dir, watchdog = Path(OUT_DIR), None
    ck_root = out_dir / "checkpoints"
    if not d.colocated:
        watchdog = Watchdog(d.store, d.rank, d.world, d.roles, HEARTBEAT_TIMEOUT, STALL_TIMEOUT, log=log,
                            is_master=d.is_master)
        watchdog.start()
    stop_flag = on_signals(d, watchdog, ck_root)
    try:
        # 1. settings that need the target's config and tokenizer, the data: all checked before any model loads
        dcfg, hf_cfg, eval_setup = drafter_config(d, config)
        init_notes = check_init_from(dcfg) if INIT_FROM else []
        data = load_data(d, config, hf_cfg, watchdog)
        # 2. where to start
        resume_path = choose_resume(d, watchdog, out_dir, ck_root)
        fingerprint = ckpt.target_fingerprint(TARGET)
        rp = resume(d, watchdog, resume_path, config, data, dcfg, fingerprint)
        try:
            sched = Schedule(data.plan.num_batches, d.n_targets, d.n_drafters, GRAD_ACCUM, LR, WARMUP_RATIO, EPOCHS,
                             MAX_STEPS, rp.start_g, rp.planned_g)
        except DataError as e:
            sys.exit(f"error: {e}")
        total_steps = rp.step + sched.steps
        if d.is_master:
            log_plan(d, config, data, sched, dcfg, rp.step, total_steps, resume_path, init_notes)
        if DRY_RUN:
            if d.is_master:
                log("DRY_RUN: config and data are fine; exiting before loading any model")
            finish(d, watchdog, code=0)
        if d.is_master:
            write_run_info(d, out_dir, config, data, dcfg, fingerprint, resume_path)
        # 3. a target rank's job
        target = load_target(d, dcfg, watchdog) if d.is_target else None
        if d.is_target and not d.colocated:
            run_target(d, data, sched, target, watchdog)
        # 4. a drafter rank's (or the one process's) job
        drafter, model, opt, embed, head_w = build_drafter(d, dcfg, target, resume_path, watchdog)
        pre_stats = {}
        feed = start_feed(d, data, sched, target, dcfg, watchdog, pre_stats)
        train(Run(d=d, dcfg=dcfg, config=config, data=data, sched=sched, drafter=drafter, model=model, opt=opt,
                  embed=embed, head_w=head_w, feed=feed, pre_stats=pre_stats, watchdog=watchdog, stop_flag=stop_flag,
                  eval_setup=eval_setup, ck_root=ck_root, fingerprint=fingerprint, step=rp.step, step0=rp.step,
                  total_steps=total_steps))
        log_peak_memory(d)
        finish(d, watchdog, code=0)
    except SystemExit as e:
        if e.code not in (0, None) and watchdog:
            watchdog.fail(str(e.code).removeprefix("error: "))
        raise
    except Exception as e:  # noqa: BLE001 - every failure ends the whole job with a reason
        reason = f"{type(e).__name__}: {e}"
        if "out of memory" in str(e).lower() and torch.cuda.is_available():
            gib = 2 ** 30
            reason = (f"CUDA out of memory on {d.device}: {torch.cuda.memory_allocated() / gib:.1f} GiB allocated, "
                      f"{torch.cuda.memory_reserved() / gib:.1f} GiB reserved of "
                      f"{torch.cuda.get_device_properties(d.device).total_memory / gib:.1f} GiB. Lower MAX_ANCHORS "
                      f"(now {MAX_ANCHORS}), TOKEN_BUDGET (now {TOKEN_BUDGET}) or MAX_BATCH_SIZE (now {MAX_BATCH_SIZE})")
        fail(watchdog, reason, traceback.format_exc())


# --- the drafter loop -------------------------------------------------------------------------------------------------

@dataclass
class Run:
    """What the drafter loop reads and updates, built by main's phases."""
    d: Dist
    dcfg: DrafterConfig
    config: dict                   # the final settings, snapshotted into every checkpoint
    data: Data
    sched: Schedule
    drafter: Drafter               # fp32 master weights
    model: torch.nn.Module         # the drafter (FSDP2-sharded with DRAFTER_SHARDING=fsdp), or its DDP wrapper
    opt: torch.optim.Optimizer
    embed: torch.nn.Embedding      # the target's, frozen
    head_w: torch.Tensor | fp8.HeadFP8   # [V, H] the target's lm_head, frozen (HEAD_FP8: with its FP8 copies)
    feed: Prefetcher | TargetAhead
    pre_stats: dict                # the one process's q_pre depth (produce writes it)
    watchdog: Watchdog | None
    stop_flag: threading.Event     # set by a signal
    eval_setup: dict | None
    ck_root: Path
    fingerprint: dict              # the target's, in every checkpoint: a resume checks its target against it
    step: int                      # optimizer steps done
    step0: int                     # ... when this run started
    total_steps: int
    metrics: Metrics | None = None
    saves: int = 0                 # checkpoints this run wrote (EVAL_EVERY counts them)
    eval_reference: dict = field(default_factory=dict)   # greedy decodes: they depend on the target and prompts only
    last_eval: dict = field(default_factory=dict)
    stop_at: int | None = None     # the step after which every drafter stops (a signal)

    def g_at(self, step):  # first micro-batch of optimizer step `step` (counted from the run's start step)
        return self.sched.g_at(step - self.step0)


@dataclass
class Meter:
    """The status line's sums and counters since the last one."""
    sums: torch.Tensor             # [8] float64, drafter_step's
    t_start: float
    t_log: float
    step_at_log: int
    tokens: int = 0
    micro_batches: int = 0
    tgt_n_prev: int = 0            # micro-batches the target ranks had made at the last status line
    split_reported: bool = False
    run_tokens: int = 0            # this rank's tokens over the whole run (the split report's wait needs them)


def train(run):
    """lr -> micro-steps -> step -> stop -> log -> save, until the schedule ends or a signal asks to stop."""
    d, B = run.d, run.dcfg.block_size
    if d.is_master:
        run.metrics = Metrics(Path(OUT_DIR), run.config)
        if run.watchdog:
            run.watchdog.on_abort.append(run.metrics.flush)
    autocast = autocast_for(d.device, d.dtype)
    params = list(run.drafter.parameters())
    step_w = torch.zeros(1, device=d.device, dtype=torch.float64)   # loss weight of this optimizer step
    clock = BusyClock(d.device)
    if run.watchdog:
        run.watchdog.collect.append(clock.poll)
    now = time.time()
    meter = Meter(torch.zeros(8, device=d.device, dtype=torch.float64), now, now, run.step,
                  split_reported=d.colocated)
    if d.is_master:
        log(f"[rank {d.rank} {d.role}] waiting for the first micro-batch (target warm-up, queues filling) ...")
    first = True
    while run.step < run.total_steps:
        lr = run.sched.lr(run.g_at(run.step))
        for group in run.opt.param_groups:
            group["lr"] = lr
        for m in range(GRAD_ACCUM):
            item = run.feed.get()
            if first:
                first = False
                first_micro_batch(run, meter)
            if run.watchdog:
                run.watchdog.state = f"training step {run.step + 1} micro-batch g={item.g}"
            t0 = clock.start()
            sums = drafter_step(run.model, run.embed, run.head_w, item, B, autocast,
                                sync=m == GRAD_ACCUM - 1 or d.n_drafters == 1)
            if m < GRAD_ACCUM - 1:
                clock.stop(t0, item.tokens)
            else:                                      # the step's last micro-batch: its busy time ends after the
                last_unit = (t0, item.tokens)          # optimizer, which is part of the drafter's per-step cost
            step_w += sums[7]
            meter.sums += sums
            micro_batch_done(run, meter, item)
        optimizer_step(params, run.opt, step_w, d.n_drafters, d.drafters)
        clock.stop(*last_unit)
        run.step += 1
        stopping = stop_requested(run)
        now = time.time()
        log_now = run.step - meter.step_at_log >= LOG_EVERY or now - meter.t_log >= LOG_SECONDS or \
            run.step == run.total_steps or stopping
        if d.n_drafters > 1:   # every drafter must join the metric all-reduce: agree on when via the step count
            log_now = run.step % LOG_EVERY == 0 or run.step == run.total_steps or stopping
        if log_now:
            status_line(run, meter, params, lr, now)
        writes = d.is_master or DRAFTER_SHARDING == "fsdp"   # sharded: every drafter rank writes its shard
        if writes and (run.step % SAVE_EVERY == 0 or run.step == run.total_steps or stopping):
            t_pause = time.time()
            save_checkpoint(run)
            meter.t_log += time.time() - t_pause   # checkpoint and evaluation time is not training throughput
        if stopping:
            if d.is_master:
                log(f"stopped at step {run.step} on request; resume with RESUME=auto")
            break
    run.opt.wait_all()
    if d.is_master:
        if run.step >= run.total_steps:
            log(f"done: {run.step} steps; final drafter in {ckpt.step_dir(run.ck_root, run.step) / 'drafter'}")
        run.metrics.flush()


def first_micro_batch(run, meter):
    """Start-up is over: stall detection on, the clocks restart (start-up is not throughput)."""
    d = run.d
    if run.watchdog:
        run.watchdog.steady = True
    if d.is_master:
        log(f"[rank {d.rank} {d.role}] first micro-batch after {time.time() - meter.t_start:.1f}s; training")
    meter.t_start = meter.t_log = time.time()
    if d.is_master and run.watchdog:
        meter.tgt_n_prev = sum((s or {}).get("n", 0) for s in run.watchdog.peer_states(range(d.n_targets)).values())


def micro_batch_done(run, meter, item):
    if DUMP_BATCHES and item.g < DUMP_BATCHES:   # exactly what arrived, for checking the transport
        dump = Path(OUT_DIR) / "dump"
        dump.mkdir(parents=True, exist_ok=True)
        torch.save({"g": item.g, "rank": run.d.rank, "features": item.features.cpu(), "lengths": item.lengths,
                    "input_ids": item.input_ids}, dump / f"g{item.g:06d}.pt")
    meter.tokens += item.tokens
    meter.run_tokens += item.tokens
    meter.micro_batches += 1
    if run.watchdog:
        run.watchdog.progress()
        run.watchdog.stats.update(q=run.feed.q.qsize(), n=run.watchdog.stats.get("n", 0) + 1,
                                  tok=run.watchdog.stats.get("tok", 0) + item.tokens)


def stop_requested(run) -> bool:
    """A signal on any rank -> every drafter stops after the same step, agreed through the store (the master
    publishes it, and the micro-batch the target ranks stop before). -> whether this step is the last."""
    d = run.d
    if d.store:
        if run.stop_flag.is_set() and not d.store.check(["stop_request"]):
            d.store.set("stop_request", str(d.rank))
        if d.is_master and run.stop_at is None and d.store.check(["stop_request"]):
            run.stop_at = run.step + 1
            d.store.set("stop_at", str(run.stop_at))
            d.store.set("stop_g", str(run.g_at(run.stop_at)))
        if run.stop_at is None and d.store.check(["stop_at"]):
            run.stop_at = int(d.store.get("stop_at"))
    elif run.stop_flag.is_set() and run.stop_at is None:
        run.stop_at = run.step
    return run.stop_at is not None and run.step >= run.stop_at


def status_line(run, meter, params, lr, now):
    """The metrics since the last line, all-reduced over the drafters (every drafter calls this at the same step),
    then on the master one line and one metrics.jsonl row. Also checks that DDP kept the drafters identical (FSDP2's
    ranks hold different shards: ddp_weight_spread is null)."""
    d, step = run.d, run.step
    red = meter.sums.clone()
    spread = 0.0 if DRAFTER_SHARDING == "ddp" else None
    if d.n_drafters > 1:
        dist.all_reduce(red, group=d.drafters)
    if d.n_drafters > 1 and DRAFTER_SHARDING == "ddp":
        # DDP keeps drafters bitwise identical; check it where we sync anyway
        run.opt.wait_all()
        cs = torch.stack([p.detach().double().sum() for p in params]).sum()
        mm = torch.stack([cs, -cs])
        dist.all_reduce(mm, op=dist.ReduceOp.MAX, group=d.drafters)
        spread = float(mm[0] + mm[1])
        if spread != 0.0:
            raise RuntimeError(f"drafter ranks hold different weights after step {step} (checksum spread "
                               f"{spread:g}): DDP gradient sync is broken")
    loss, wt, an, ad, sn, sd, obj, obj_w = red.tolist()
    meter.sums.zero_()
    if d.is_master:
        dt = max(1e-9, now - meter.t_log)
        peers = run.watchdog.peer_states() if run.watchdog else {}
        tgt_n = sum((peers.get(r) or {}).get("n", 0) for r in range(d.n_targets))
        if d.colocated:
            q_pre, q_hs = [run.pre_stats.get("q", 0)], [run.feed.q.qsize()]
        else:
            q_pre = [(peers.get(r) or {}).get("q", 0) for r in range(d.n_targets)]
            q_hs = [(peers.get(r) or {}).get("q", 0) for r in range(d.n_targets, d.world)]
        tgt_rate = (tgt_n - meter.tgt_n_prev) / dt if not d.colocated else meter.micro_batches / dt
        meter.tgt_n_prev = tgt_n
        dft_rate = meter.micro_batches * d.n_drafters / dt
        tok_rate = meter.tokens * d.n_drafters / dt
        eta = (run.total_steps - step) * dt / max(1, step - meter.step_at_log)
        epoch = run.g_at(step) / run.data.plan.num_batches
        noise_std = NOISE / math.sqrt(3)
        row = {"time": now, "elapsed_s": now - meter.t_start, "step": step, "total_steps": run.total_steps,
               "loss": loss / max(wt, 1e-12), "objective": obj / max(obj_w, 1e-12), "acc": an / max(ad, 1),
               "streak": sn / max(sd, 1),
               "lr": lr, "noise_std": noise_std, "tgt_mb_s": tgt_rate, "dft_mb_s": dft_rate,
               "tok_s": tok_rate, "q_pre": q_pre, "q_hs": q_hs, "epoch": epoch, "eta_s": eta,
               "ddp_weight_spread": spread}
        if not meter.split_reported:
            meter.split_reported = report_split(peers, d, row)
            # enough work for this rank's clock to count (past its skipped first units), so the wait can succeed
            enough = meter.run_tokens >= split_min_tokens() + BusyClock.SKIP * TOKEN_BUDGET
            if not meter.split_reported and step == run.total_steps and enough and run.watchdog:
                # a run shorter than a few heartbeats: the peers' busy clocks arrive with their next beats. A pause:
                # this wait makes no progress, and a short STALL_TIMEOUT must not take it for a stall
                with run.watchdog.pause("waiting for the peers' busy clocks (the split report)"):
                    end = time.monotonic() + 3 * run.watchdog.interval
                    while not meter.split_reported and time.monotonic() < end:
                        time.sleep(0.2)
                        meter.split_reported = report_split(run.watchdog.peer_states(), d, row)
        run.metrics.write(row)
        tau = f" tau={run.last_eval['tau']:.2f}" if run.last_eval else ""
        dpace = f" dpace={row['objective']:.3f}" if LOSS_WEIGHTING == "dpace" else ""
        log(f"[{(now - meter.t_start) / 60:.0f}m] step={step}/{run.total_steps} loss={row['loss']:.3f}{dpace} "
            f"acc={row['acc']:.3f} streak={row['streak']:.2f}{tau} lr={lr:.1e} noise={noise_std:.3f} | "
            f"tgt={tgt_rate:.2f}b/s dft={dft_rate:.2f}b/s ({fmt_k(tok_rate)}tok/s) | "
            f"q_pre={fmt_q_pre(q_pre, d.shards)} q_hs={q_hs} | "
            f"epoch~{epoch:.2f} ETA={fmt_eta(eta)}")
    meter.t_log, meter.step_at_log, meter.tokens, meter.micro_batches = now, step, 0, 0


def save_checkpoint(run):
    """The master's checkpoint after run.step (checkpoint.py's schema), then every EVAL_EVERY-th time the
    evaluation. DRAFTER_SHARDING=fsdp: every drafter rank calls it, writes its shard into the master's folder
    (checkpoint.save_shards) and takes part in gathering the whole drafter for the serving export."""
    d = run.d
    if run.watchdog:
        run.watchdog.state = f"saving checkpoint step {run.step}"
    run.opt.wait_all()   # the overlapped optimizer's last update has run (parameters and its state)
    sharded = DRAFTER_SHARDING == "fsdp"
    full = ckpt.full_state(run.drafter, keep=d.is_master) if sharded else None   # fp32, on the master's CPU
    shards = functools.partial(ckpt.save_shards, model=run.drafter, opt=run.opt, group=d.drafters) \
        if sharded else None
    if not d.is_master:
        shards(ckpt.tmp_dir(run.ck_root, run.step))
        return
    g = run.g_at(run.step)
    state = ckpt.train_state(run.drafter, run.opt, run.step, g, sharded=sharded)
    meta = ckpt.train_meta(run.step, g, run.sched.planned_g, [d.n_targets, d.n_drafters], run.config, run.data,
                           run.dcfg, run.fingerprint)
    t = time.time()
    try:
        path = ckpt.save(run.ck_root, run.step, state, meta,
                         lambda p: export_drafter(run.drafter, p, state=full), KEEP_LAST, write_shards=shards)
    except ckpt.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    log(f"saved {path} ({time.time() - t:.1f}s)")
    run.saves += 1
    if EVAL_EVERY and run.saves % EVAL_EVERY == 0:
        evaluate(run, run.drafter if not sharded else whole_drafter(run.dcfg, full, d.device))


def whole_drafter(dcfg, state, device) -> Drafter:
    """A sharded drafter's gathered state as one plain Drafter on `device`, for the master's evaluation (the FSDP2
    module's forward is a collective of every drafter rank)."""
    with torch.device("meta"):
        drafter = Drafter(dcfg)
    drafter.load_state_dict(state, assign=True)
    return drafter.to(device)


def evaluate(run, drafter):
    """tau of the current drafter (run.drafter, or its whole copy when sharded) on EVAL_PROMPTS, on this rank; peers
    wait at the next collective, targets keep filling the queues. The watchdog knows (its stall check pauses), and
    the HF target it loads in EVAL_DTYPE is freed afterwards (planner.py counts it in the drafter's peak)."""
    d, setup = run.d, run.eval_setup
    run.opt.wait_all()
    t = time.time()
    with run.watchdog.pause(f"evaluating tau at step {run.step}") if run.watchdog else contextlib.nullcontext():
        target_model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=getattr(torch, EVAL_DTYPE),
                                                            attn_implementation="sdpa",
                                                            local_files_only=True).to(d.device).eval()
        drafter.eval()
        with torch.no_grad():
            res = eval_dflash.evaluate(target_model, setup["tok"], drafter, setup["prompts"],
                                       max_new_tokens=EVAL_MAX_NEW_TOKENS, device=d.device, on_too_long="skip",
                                       reference=run.eval_reference, enable_thinking=setup["enable_thinking"], log=None)
        del target_model
        if d.device.type == "cuda":
            torch.cuda.empty_cache()   # give the evaluation's memory back to training
    drafter.train()
    run.last_eval.update(tau=res["tau"], lossless=res["lossless"])
    run.metrics.write({"time": time.time(), "step": run.step, "tau": res["tau"], "lossless": res["lossless"],
                       "tau_by_category": res.get("tau_by_category"), "tf_streak": res.get("tf_streak"),
                       "eval_s": time.time() - t})
    # tf_streak: the training streak measured on these prompts' greedy outputs. tau ~ 1 + tf_streak when serving
    # matches training; tf_streak far below the status line's streak = the drafter does not generalise to them
    tf = res.get("tf_streak")
    log(f"eval step {run.step}: tau={res['tau']:.2f} lossless={'yes' if res['lossless'] else 'no'} "
        f"prompts={len(setup['prompts'])} held-out streak={'-' if tf is None else f'{tf:.2f}'} "
        f"({time.time() - t:.0f}s)")


if __name__ == "__main__":
    main(sys.argv[1:])
