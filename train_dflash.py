"""Train a DFlash drafter in one torchrun job: target ranks run the frozen target and stream hidden states to
drafter ranks, which train the drafter with DDP among themselves. No external services.

    bash launch.sh                                                     # the usual way (tmux, log, allocator)
    torchrun --nproc-per-node 8 train_dflash.py --TARGET=/models/Qwen3-8B --DATA=/data/prepared --TARGET_RANKS=5
    python train_dflash.py --MAX_STEPS=20                              # one process: target and drafter in turn

Every constant below can be overridden as --NAME=VALUE. The final values are printed, saved in OUT_DIR/run.json
and in every checkpoint.
"""
import contextlib
import difflib
import hashlib
import json
import math
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

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
MAX_ANCHORS = 512           # blocks per micro-batch (anchors sampled without replacement, fresh every step)
MIN_ANCHORS_PER_DOC = 1     # floor per sequence when MAX_ANCHORS binds, so short sequences are not starved
GAMMA = 7.0                 # loss weight of slot k is exp(-(k-1)/GAMMA); 7 for B=16, 10 for B=32
LOSS_WEIGHTING = "exp"      # exp (exp(-(k-1)/GAMMA), the paper's) | dpace (D-PACE, vLLM speculators' default)
DPACE_ALPHA = 0.5           # D-PACE confidence smoothing in [0, 1]: slot weights from (1-a)*q + a, q = p(label)
NOISE = 0.0                 # uniform noise U(-NOISE, NOISE) on target hidden states before fc (0 = off)
CE_CHUNK = 4096             # rows of [rows, vocab] logits alive at once in the loss (0 = unchunked, tests only)

# --- data -----------------------------------------------------------------------------------------------------------
TOKEN_BUDGET = 16384        # tokens per micro-batch, padding included (target forward is [b, S] padded)
MAX_BATCH_SIZE = 64         # sequences per micro-batch
EPOCHS = 6                  # passes over the data
ALLOW_DATA_CHANGE = False   # resume even if the dataset changed (the LR schedule is re-planned over the new total)

# --- optimisation ---------------------------------------------------------------------------------------------------
GRAD_ACCUM = 1              # micro-batches per drafter rank per optimizer step
LR = 6e-4                   # peak learning rate (AdamW, fp32 master weights)
WARMUP_RATIO = 0.04         # fraction of the run spent in linear warmup, then cosine to 0
WEIGHT_DECAY = 0.0          # AdamW weight decay (0.0 - 0.01)
GRAD_CLIP = 1.0             # max global grad norm
MAX_STEPS = 0               # optimizer steps of the run; 0 = EPOCHS over the data (the schedule spans the run)

# --- topology and hardware --------------------------------------------------------------------------------------------
TARGET_RANKS = 1            # the first TARGET_RANKS ranks run the target, the rest train the drafter
DEVICE = "auto"             # auto | cuda | cpu
DTYPE = "auto"              # auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float32
ATTN = "auto"               # auto (flex on GPU, sdpa on CPU) | flex | sdpa
COMPILE_DRAFTER = "off"     # off | elementwise (fused RMSNorm + RoPE kernels) | layers (that + each layer one graph)
COMPILE_TARGET = False      # torch.compile each target decoder layer (one process too: warmed up on the main thread)
TARGET_FP8 = False          # frozen target's Linear layers in FP8 (rowwise scales) on GPU (SM89+, torchao)
DRAFTER_FP8 = False         # drafter Linear layers trained in FP8 (torchao float8 training, rowwise)
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

CONFIG_KEYS = [k for k in list(globals()) if k.isupper() and not k.startswith("_")]
REPO = Path(__file__).resolve().parent
SECOND_SIGNAL_S = 2.0       # a signal this long after the first ends the job now; sooner it is the same one, forwarded
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")   # what a TARGET folder holds its weights in
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
    "TARGET_RANKS": (1, False), "Q_PREFETCH": (1, False), "Q_HS": (1, False), "SEND_DEPTH": (1, False),
    "SAVE_EVERY": (1, False), "KEEP_LAST": (0, False), "SEED": (0, False), "LOG_EVERY": (1, False),
    "LOG_SECONDS": (0, True), "HEARTBEAT_TIMEOUT": (0, True), "STALL_TIMEOUT": (0, True), "EVAL_EVERY": (0, False),
    "EVAL_LIMIT": (1, False), "EVAL_MAX_NEW_TOKENS": (1, False), "DUMP_BATCHES": (0, False),
}


# --- configuration ----------------------------------------------------------------------------------------------------

def parse_overrides(argv: list[str]) -> dict:
    """--NAME=VALUE for the constants above; unknown names and wrong types are errors."""
    g = globals()
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
    return {k: g[k] for k in CONFIG_KEYS}


def resolve_paths() -> None:
    """Fill the embedded defaults: SmolLM2 from the cache, the shipped dataset."""
    global TARGET, DATA
    if not TARGET:
        from tools.smollm2 import DEFAULT_CACHE
        TARGET = str(DEFAULT_CACHE)
        if not (DEFAULT_CACHE / "config.json").exists():
            sys.exit(f"error: no TARGET given and the default SmolLM2 folder {DEFAULT_CACHE} does not exist: run "
                     f"`python -m tools.smollm2` (launch.sh does) or pass --TARGET=/path/to/hf/model")
    if not DATA:
        DATA = str(REPO / "data" / "default" / "smollm2")


def check_config(world: int) -> None:
    """Contradictions a user can fix, reported before any model is loaded."""
    errs = []
    if world > 1 and not 1 <= TARGET_RANKS < world:
        errs.append(f"TARGET_RANKS={TARGET_RANKS} must be between 1 and world size - 1 = {world - 1} "
                    f"(at least one drafter rank); launch more processes or lower TARGET_RANKS")
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
        arch = json.loads((tgt / "config.json").read_text()).get("architectures") or []
        if not any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in arch):
            errs.append(f"TARGET={TARGET} is not a causal LM (architectures={arch}); DFlash needs a decoder-only "
                        f"*ForCausalLM target")
        elif not any(next(tgt.glob(pat), None) for pat in WEIGHT_FILES):
            errs.append(f"TARGET={TARGET} has a config.json but no weights ({', '.join(WEIGHT_FILES)}): download the "
                        f"model's weight files into it")
    if FLEX_OPTIONS:
        try:
            if not isinstance(json.loads(FLEX_OPTIONS), dict):
                raise ValueError
        except ValueError:
            errs.append(f"FLEX_OPTIONS={FLEX_OPTIONS!r} is not a JSON object of flex_attention kernel_options "
                        f"(e.g. '{{\"USE_TMA\": true}}'; \"\" for torch's defaults)")
    from model.drafter import COMPILE_MODES
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
    from model.drafter import DrafterConfig
    src = DrafterConfig.from_serving(json.loads((Path(INIT_FROM) / "config.json").read_text()))

    def as_setting(field, cfg):   # the field as the value of the setting that decides it
        v = getattr(cfg, field)
        return {"target_layer_ids": lambda: ",".join(map(str, v)),
                "layer_types": lambda: v.count("sliding_attention"), "sliding_window": lambda: v or 0}.get(field,
                                                                                                    lambda: v)()
    errs, of_target = [], []
    for field, setting in INIT_FROM_FIELDS:
        ours, theirs = as_setting(field, dcfg), as_setting(field, src)
        if ours == theirs:
            continue
        if setting == "TARGET":
            of_target.append((field, ours, theirs))
        else:
            errs.append(f"{setting}: this run has {ours} ({field}), the drafter in INIT_FROM {theirs}: pass "
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
    from safetensors.torch import load_file
    state = load_file(str(Path(INIT_FROM) / "model.safetensors"), device=str(next(drafter.parameters()).device))
    missing = drafter.state_dict().keys() - state.keys()
    extra = state.keys() - drafter.state_dict().keys()
    if missing or extra:
        sys.exit(f"error: INIT_FROM={INIT_FROM}: model.safetensors does not hold this drafter's parameters (missing "
                 f"{sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}); export it with model.export.export_drafter")
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in state.values()})
    drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return "/".join(dtypes)


def read_stats(data_dir) -> dict:
    """DATA/stats.json as data.prepare wrote it ({} for a dataset made another way)."""
    path = Path(data_dir) / "stats.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError as e:
        sys.exit(f"error: {path} is not JSON ({e}); prepare DATA again with `python -m data.prepare`")


def check_data_tokenizer(stats: dict, tok) -> list[str]:
    """The dataset's token ids and loss masks mean what they should only under the tokenizer and chat template it was
    prepared with: compare the hashes data.prepare recorded with TARGET's. -> one error line per mismatch."""
    from data.chat import template_hash
    from data.prepare import tokenizer_hash
    errs = []
    fix = (f"prepare DATA again with `python -m data.prepare --tokenizer {TARGET} ...`, or train the target it was "
           f"made for")
    made_with = stats.get("tokenizer", "?")
    if stats.get("tokenizer_hash") and stats["tokenizer_hash"] != tokenizer_hash(tok):
        errs.append(f"DATA={DATA} was tokenized with the tokenizer of {made_with} (vocabulary hash "
                    f"{stats['tokenizer_hash'][:12]}), TARGET={TARGET} has another one ({tokenizer_hash(tok)[:12]}): "
                    f"its token ids mean other tokens; {fix}")
    if stats.get("chat_template_hash") and stats["chat_template_hash"] != template_hash(tok):
        errs.append(f"DATA={DATA} was rendered with the chat template of {made_with} (hash "
                    f"{stats['chat_template_hash'][:12]}), TARGET={TARGET}'s template differs "
                    f"({template_hash(tok)[:12]}): the drafter would learn text laid out unlike what the target serves; "
                    f"{fix}")
    return errs


def eval_inputs(tok, stats: dict) -> dict:
    """EVAL_EVERY's prompts, checked at start-up (a bad row used to end the job at its first evaluation), and the
    dataset's thinking mode (data.prepare's stats.json), so the drafter is measured on prompts rendered as it was
    trained. tok: TARGET's tokenizer or None. -> {prompts, enable_thinking, path, tok}."""
    from eval_dflash import load_prompts, prompt_messages
    path = Path(EVAL_PROMPTS or REPO / "data" / "default" / "eval_prompts.jsonl")
    try:
        prompts = load_prompts(path, limit=EVAL_LIMIT)
        for row in prompts:
            if "input_ids" not in row:
                prompt_messages(row)
                if tok is None:
                    raise ValueError(f"prompt {row['id']!r} is text, and TARGET={TARGET} has no tokenizer to encode "
                                     f"it: give its rows as input_ids")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        sys.exit(f"error: EVAL_PROMPTS={path}: {type(e).__name__ + ': ' if not isinstance(e, ValueError) else ''}{e}")
    if not prompts:
        sys.exit(f"error: EVAL_PROMPTS={path} holds no prompts (a JSONL of prompts, see eval_dflash.py)")
    thinking = stats.get("thinking")
    return {"prompts": prompts, "path": path, "enable_thinking": {"on": True, "off": False}.get(thinking), "tok": tok}


def target_fingerprint(path) -> dict:
    """What identifies a target without loading it: its config.json (hashed, less the fields a re-save changes) and
    its weight files' headers plus their first MiB of tensor data (another checkpoint of the same architecture
    differs there)."""
    path = Path(path).expanduser()
    cfg = json.loads((path / "config.json").read_text())
    for k in ("_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    weights = hashlib.sha256()
    for f in sorted(p for pat in WEIGHT_FILES for p in path.glob(pat)):
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if f.suffix == ".safetensors" else 0
            weights.update(f.name.encode() + head + fh.read(n + (1 << 20)))
    config_sha = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()
    return {"path": str(path.resolve()), "config_sha256": config_sha, "weights_sha256": weights.hexdigest()}


# drafter config field -> the setting that decides it (fields not listed come from the target's config)
SHAPED_BY = {"num_hidden_layers": "NUM_DRAFT_LAYERS", "block_size": "BLOCK_SIZE",
             "target_layer_ids": "TARGET_LAYER_IDS", "mask_token_id": "MASK_TOKEN_ID",
             "layer_types": "SLIDING_WINDOW_LAYERS", "sliding_window": "SLIDING_WINDOW"}


def resume_mismatches(meta: dict, dcfg, fingerprint: dict) -> list[str]:
    """What a checkpoint was written for that this run would change: the drafter's shape (by setting) and the target
    (by fingerprint). -> one line per difference, naming the setting and both values."""
    errs = []
    old = meta.get("drafter") or {}
    for field, new in dcfg.__dict__.items():
        if field in old and old[field] != new:
            name = SHAPED_BY.get(field, f"TARGET (its config's {field})")
            errs.append(f"{name}: the checkpoint has {field}={old[field]}, this run {new}")
    was = meta.get("target")
    if was and (was["config_sha256"], was["weights_sha256"]) != (fingerprint["config_sha256"],
                                                                 fingerprint["weights_sha256"]):
        what = "config and weights" if was["config_sha256"] != fingerprint["config_sha256"] else "weights"
        errs.append(f"TARGET: the checkpoint was trained on {was['path']} (config {was['config_sha256'][:12]}, weights "
                    f"{was['weights_sha256'][:12]}), this run's {fingerprint['path']} has other {what} (config "
                    f"{fingerprint['config_sha256'][:12]}, weights {fingerprint['weights_sha256'][:12]})")
    return errs


# --- distributed setup --------------------------------------------------------------------------------------------

class Dist:
    """Who this process is. One process (no torchrun) = target and drafter in turn, no transport."""

    def __init__(self):
        import torch
        import torch.distributed as dist
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
        if not self.colocated:
            backend = "nccl" if use_cuda else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=max(1800.0, STALL_TIMEOUT)),
                                    device_id=self.device if use_cuda else None)
            assert dist.get_world_size() == self.world
            self.data = dist.group.WORLD                                        # features: NCCL on GPU
            self.ctrl = dist.new_group(backend="gloo")                          # headers and token ids: CPU
            self.drafters = dist.new_group(list(range(self.n_targets, self.world)))  # DDP among drafters only
            self.store = dist.distributed_c10d._get_default_store()

    def __str__(self):
        return (f"rank {self.rank}/{self.world} {self.role} on {self.device} ({self.dtype}, "
                f"attention={'flex' if self.flex else 'sdpa'}) pid {os.getpid()}")


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


# --- data -----------------------------------------------------------------------------------------------------------

def read_arrow_dataset(path):
    """A `datasets.save_to_disk` folder as one pyarrow Table, read straight from its Arrow files (memory-mapped):
    training hosts need pyarrow, not the `datasets` package."""
    import pyarrow as pa
    path = Path(path)
    state = path / "state.json"
    if not state.exists():
        from datasets import load_from_disk   # some other layout: let datasets read it
        return load_from_disk(str(path)).flatten_indices().data.table
    files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    return pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files])


class Data:
    """The prepared dataset as flat numpy arrays (fast random access from any thread), rows that cannot train
    dropped with a count per reason, and the batch plan."""

    def __init__(self, path, vocab_rows, block_size):
        import numpy as np
        from data.batching import BatchPlan
        try:
            table = read_arrow_dataset(path)
        except Exception as e:  # noqa: BLE001 - any unreadable folder gets the same advice
            sys.exit(f"error: cannot load the dataset at DATA={path} ({type(e).__name__}: {e}); prepare it with "
                     f"`python -m data.prepare`")
        missing = {"input_ids", "loss_mask"} - set(table.column_names)
        if missing:
            sys.exit(f"error: dataset {path} lacks column(s) {sorted(missing)}; prepare it with `python -m data.prepare`")
        ids_col, mask_col = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
        self.offsets = ids_col.offsets.to_numpy().astype(np.int64)                        # [n+1]
        self.ids = ids_col.flatten().to_numpy().astype(np.int64)                         # [tokens]
        mask_offsets = mask_col.offsets.to_numpy().astype(np.int64)
        self.mask = mask_col.flatten().to_numpy().astype(np.uint8)
        n = len(self.offsets) - 1
        lengths = np.diff(self.offsets)
        h = hashlib.sha256()
        for arr in (self.offsets, self.ids, self.mask):
            h.update(np.ascontiguousarray(arr).tobytes())
        self.content_hash = h.hexdigest()
        self.num_rows = n

        # rows that cannot train are dropped here, counted by reason, never met at step 10,000
        reasons = {}
        ok = np.ones(n, dtype=bool)

        def drop(bad, why):
            nonlocal ok
            bad = bad & ok
            if bad.any():
                reasons[why] = int(bad.sum())
                ok &= ~bad
        same_len = np.diff(mask_offsets) == lengths
        drop(~same_len, "loss_mask_length_differs")
        if not same_len.all():   # the flat mask must line up with the flat ids; the dropped rows' masks are zeros
            aligned = np.zeros(len(self.ids), dtype=np.uint8)
            for r in np.nonzero(same_len)[0]:
                aligned[self.offsets[r]:self.offsets[r + 1]] = self.mask[mask_offsets[r]:mask_offsets[r + 1]]
            self.mask = aligned
        row_of_token = np.repeat(np.arange(n), lengths)
        bad_tok = np.zeros(n, dtype=bool)
        bad_tok[row_of_token[(self.ids < 0) | (self.ids >= vocab_rows)]] = True
        drop(bad_tok, f"token_id_outside_vocab_0..{vocab_rows - 1}")
        drop(lengths > TOKEN_BUDGET, f"longer_than_TOKEN_BUDGET_{TOKEN_BUDGET}")
        # valid anchor: mask[p] & mask[p+1] inside one row
        pair = np.zeros(len(self.mask), dtype=bool)
        if len(self.mask) > 1:
            pair[:-1] = (self.mask[:-1] > 0) & (self.mask[1:] > 0)
        last = self.offsets[1:] - 1
        pair[last[last >= 0]] = False
        has_anchor = np.zeros(n, dtype=bool)
        has_anchor[row_of_token[pair]] = True
        drop(~has_anchor, "no_two_consecutive_supervised_tokens")
        self.dropped = reasons
        self.rows = np.nonzero(ok)[0]                                                     # plan index -> row
        if len(self.rows) == 0:
            sys.exit(f"error: no trainable rows in {path} (dropped: {reasons})")
        self.plan = BatchPlan(lengths[self.rows].tolist(), TOKEN_BUDGET, MAX_BATCH_SIZE, seed=SEED)

    def batch(self, g):
        """Padded CPU tensors of micro-batch g: input_ids, loss_mask, attention_mask [b, S]; lengths [b]."""
        import torch
        rows = self.rows[self.plan.batch(g)]
        lens = [int(self.offsets[r + 1] - self.offsets[r]) for r in rows]
        S = max(lens)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.uint8)
        attn = torch.zeros(len(rows), S, dtype=torch.long)
        for i, (r, n) in enumerate(zip(rows, lens)):
            a = self.offsets[r]
            ids[i, :n] = torch.from_numpy(self.ids[a:a + n])
            mask[i, :n] = torch.from_numpy(self.mask[a:a + n])
            attn[i, :n] = 1
        return ids, mask, attn, torch.tensor(lens, dtype=torch.long)


# --- schedule -------------------------------------------------------------------------------------------------------

class Schedule:
    """Micro-batch g (global over epochs) is made by target g % n_targets. From the run's start g0 on, optimizer
    step i consumes g0 + i*per_step .. g0 + (i+1)*per_step - 1, and drafter d takes those with
    (g - g0) % per_step % n_drafters == d. The LR is a function of data progress g / total_g, so a run resumed with
    another target:drafter split (another per_step) continues at the same micro-batch with the same LR."""

    def __init__(self, num_batches, n_targets, n_drafters, start_g=0, total_g=None):
        self.nb, self.T, self.D, self.g0 = num_batches, n_targets, n_drafters, start_g
        self.per_step = n_drafters * GRAD_ACCUM
        if total_g is None:   # a fresh plan (a resume keeps the checkpoint's, unless data or length settings changed)
            total_g = EPOCHS * num_batches
            if MAX_STEPS:
                total_g = min(total_g, MAX_STEPS * self.per_step)
        self.planned_g = total_g                                               # the LR schedule's length
        self.steps = (total_g - start_g) // self.per_step                      # optimizer steps left
        self.total_g = start_g + self.steps * self.per_step                    # last micro-batch consumed + 1
        if self.steps <= 0 and start_g:
            sys.exit(f"error: the checkpoint already finished its schedule ({total_g} micro-batches, "
                     f"{total_g / num_batches:.2f} epochs); raise EPOCHS or MAX_STEPS to train further")
        if self.steps <= 0:
            sys.exit(f"error: nothing to train: {num_batches} micro-batches per epoch x EPOCHS={EPOCHS} "
                     f"(MAX_STEPS={MAX_STEPS}) gives {total_g} micro-batches, the run starts at micro-batch {start_g} "
                     f"and one optimizer step needs {self.per_step} (drafters x GRAD_ACCUM); add data, raise EPOCHS "
                     f"or lower TOKEN_BUDGET")

    def producer(self, g):
        return g % self.T

    def consumer(self, g):  # drafter index
        return (g - self.g0) % self.per_step % self.D

    def drafter_gs(self, d):
        """The g's drafter d consumes, in order."""
        for i in range(self.steps):
            for m in range(GRAD_ACCUM):
                yield self.g0 + i * self.per_step + m * self.D + d

    def lr(self, g):
        warm = WARMUP_RATIO * self.planned_g
        if g < warm:   # capped: a warmup shorter than one optimizer step (fractional warm) must not overshoot LR
            return LR * min(1.0, (g + 1) / warm)
        return LR * 0.5 * (1 + math.cos(math.pi * min(1.0, (g - warm) / max(1.0, self.planned_g - warm))))


class BusyClock:
    """Seconds and tokens a role spends computing, so the master can measure each role's capacity (not only the
    pipeline's rate, which the slower role sets). On GPU: CUDA events around each unit of work, summed by the
    watchdog thread once they have completed, so the hot loop never syncs. The first `skip` units are not counted:
    they include torch.compile's compiles (COMPILE_*, flex_attention at the real mask lengths) and allocator
    warm-up.
    """

    def __init__(self, device, skip=3):
        import collections
        self.cuda = device.type == "cuda"
        self.pending = collections.deque()   # (start event, end event, tokens), appended by the worker thread
        self.seconds, self.tokens = 0.0, 0
        self.skip = skip

    def start(self):
        if self.cuda:
            import torch
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, t0, tokens):
        if self.skip > 0:
            self.skip -= 1
            return
        if self.cuda:
            import torch
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pending.append((t0, e, tokens))
        else:
            self.seconds += time.perf_counter() - t0
            self.tokens += tokens

    def poll(self) -> dict:
        while self.pending and self.pending[0][1].query():
            s, e, tok = self.pending.popleft()
            self.seconds += s.elapsed_time(e) / 1000
            self.tokens += tok
        return {"busy_s": self.seconds, "busy_tok": self.tokens}


def micro_seed(g: int) -> int:
    """Anchors and noise of micro-batch g depend on (SEED, g) only: any split, any resume point, same draws."""
    return (SEED * 1_000_003 + g) % (2 ** 63 - 1)


# --- the target ranks -----------------------------------------------------------------------------------------------

def target_features(target, ids, attn, device):
    """[b, S] padded -> features [T, K*H] of the real tokens, packed, on device."""
    feats = target.features(ids.to(device, non_blocking=True), attn.to(device, non_blocking=True))  # [b, S, K*H]
    keep = attn.flatten().nonzero().squeeze(1)       # found on the CPU: a boolean index on the GPU would sync
    return feats.flatten(0, 1).index_select(0, keep.to(device, non_blocking=True))  # [T, K*H]


def produce(d, data, sched, target, start_g, stop_g, watchdog, clock=None, stats=None):
    """Yields Packets of this target rank's micro-batches from a prefetch thread (q_pre). Its depth goes to
    stats["q"]: the watchdog's (published to the master), or the given dict in the one-process mode."""
    stats = watchdog.stats if watchdog else stats
    from pipe import Packet
    q_pre = queue.Queue(maxsize=Q_PREFETCH)
    mine = range(start_g + (d.rank - start_g) % d.n_targets if not d.colocated else start_g, sched.total_g,
                 d.n_targets)

    def prefetch():
        try:
            for g in mine:
                ids, mask, attn, lens = data.batch(g)
                if d.device.type == "cuda":
                    ids, attn = ids.pin_memory(), attn.pin_memory()
                q_pre.put((g, ids, mask, attn, lens))
            q_pre.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            if watchdog:
                watchdog.fail(f"prefetch thread: {type(e).__name__}: {e}", traceback.format_exc())
            q_pre.put(e)   # the one-process mode has no watchdog: its feeder thread raises it on
    threading.Thread(target=prefetch, daemon=True, name="prefetch").start()
    while True:
        item = q_pre.get()
        if item is None:
            return
        if isinstance(item, BaseException):
            raise RuntimeError(f"prefetch thread: {type(item).__name__}: {item}") from item
        g, ids, mask, attn, lens = item
        if g >= stop_g():
            return
        if watchdog:
            watchdog.state = f"target forward g={g}"
        if stats is not None:
            stats["q"] = q_pre.qsize()
        keep = attn.bool()
        t0 = clock.start() if clock else None
        feats = target_features(target, ids, attn, d.device)
        if clock:
            clock.stop(t0, int(lens.sum()))
        yield Packet(g, lens, ids[keep], mask[keep], feats)


def colocated_feed(d, data, sched, target, start_g, stop_g, prepare):
    """One process (target and drafter on one device): the target forward and prepare run on a feeder thread and
    its own CUDA stream, Q_HS micro-batches ahead, while the main thread trains; as a drafter rank's Receiver does,
    so the device never idles while the CPU plans anchors and masks. Returns next_item(), which raises a feeder
    error in the main thread; next_item.queues() -> ([q_pre depth], [q_hs depth]) for the status line."""
    import torch
    from pipe import handoff
    q, pre = queue.Queue(maxsize=Q_HS), {}
    packets = produce(d, data, sched, target, start_g, stop_g, None, stats=pre)

    def feed():
        try:
            cuda = d.device.type == "cuda"
            stream = torch.cuda.Stream(d.device) if cuda else None
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for p in packets:
                    item = prepare(p)
                    q.put((item, stream.record_event() if cuda else None))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread (its traceback travels with it)
            q.put((e, None))
    threading.Thread(target=feed, daemon=True, name="feeder").start()

    def next_item():
        item, done = q.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"feeder thread (target forward + prepare): {type(item).__name__}: {item}") from item
        return handoff(item, done, d.device)
    next_item.queues = lambda: ([pre.get("q", 0)], [q.qsize()])
    return next_item


# --- the drafter ranks --------------------------------------------------------------------------------------------

class Prepared:
    """A received micro-batch with its blocks and masks built, ready for one forward/backward."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def device_tensors(self):
        import torch
        ts = [self.features, self.ctx_pos, self.block_ids, self.block_pos, self.labels, self.weights, self.rows]
        for m in (self.attn.full, self.attn.sliding):
            if isinstance(m, torch.Tensor):
                ts.append(m)
            elif m is not None:   # a flex BlockMask: its index tensors and its mask_mod's captured tensors were
                #                   written on the receiver's stream too
                ts += [t for t in m.as_tuple() if isinstance(t, torch.Tensor)]
                ts += [c.cell_contents for c in (m.mask_mod.__closure__ or ())
                       if isinstance(c.cell_contents, torch.Tensor)]
        return ts


def scale_clip_(params, scale, max_norm: float, opt=None):
    """Gradients times scale, then their global norm clipped to max_norm: the result of a per-parameter mul_
    followed by clip_grad_norm_ (the norm of the scaled gradients is scale times the norm of the unscaled ones).
    scale: a 0-dim or [1] tensor on the gradients' device (no host sync). Returns the scaled norm, before clipping.
    With a fused torch optimizer as opt the gradients are left as they are and the factor goes to its next step
    (opt.grad_scale, which GradScaler uses too: the fused AdamW kernel divides each gradient by it as it reads it),
    which saves a pass over every gradient; otherwise one foreach multiply."""
    import torch
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    scale = scale.reshape(())
    total = torch.nn.utils.get_total_norm(grads) * scale
    coef = scale * torch.clamp(max_norm / (total + 1e-6), max=1.0)                # clip_grad_norm_'s coefficient
    if opt is not None and opt.defaults.get("fused"):
        opt.grad_scale = (1.0 / coef).reshape(1).float()
    else:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def mask_lengths(cfg, device, flex):
    """The flex masks' fixed (Q_LEN, KV_LEN) on a GPU: MAX_ANCHORS blocks against TOKEN_BUDGET context rows, so
    flex_attention compiles once, for static shapes. None (each mask its own length) for the CPU's masks."""
    import torch
    from model.attention import static_lengths
    if not flex or torch.device(device).type != "cuda":
        return None
    return static_lengths(MAX_ANCHORS, cfg.block_size, TOKEN_BUDGET)


def make_prepare(cfg, device, flex):
    """Packet -> Prepared: anchors and blocks planned on the CPU from (SEED, g), moved to the device once."""
    import torch
    from model.objective import make_blocks, pack, sample_anchors

    lengths = mask_lengths(cfg, device, flex)

    def prepare(p):
        doc_ids, positions = pack(p.lengths)                                                    # [T], [T]
        gen = torch.Generator().manual_seed(micro_seed(p.g))
        anchors = sample_anchors(p.loss_mask, doc_ids, MAX_ANCHORS, gen, MIN_ANCHORS_PER_DOC)  # [N]
        blk = make_blocks(p.input_ids, p.loss_mask, doc_ids, positions, anchors, cfg.block_size, GAMMA,
                          cfg.mask_token_id)
        w = blk.weights.flatten()                                                               # [N*B]
        rows = (w > 0).nonzero().squeeze(1)                                                     # supervised slots
        from model.attention import make_attn_spec, to_device
        attn = make_attn_spec(blk.anchor_idx, blk.anchor_doc, doc_ids, cfg.block_size, cfg.layer_types,
                              cfg.sliding_window, flex, device, lengths)  # a BlockMask is planned on the CPU
        return Prepared(g=p.g, tokens=p.num_tokens, num_blocks=len(anchors), features=p.features,
                        lengths=p.lengths, input_ids=p.input_ids,
                        ctx_pos=to_device(positions, device), block_ids=to_device(blk.ids.flatten(), device),
                        block_pos=to_device(blk.positions.flatten(), device),
                        labels=to_device(blk.labels.flatten(), device), weights=to_device(w, device),
                        rows=to_device(rows, device), attn=attn)
    return prepare


def loss_reweight(item, block_size):
    """LOSS_WEIGHTING=dpace: D-PACE's weights, which weighted_ce makes from the drafter's own predictions (detached)
    after its chunks; exp: None, the decay make_blocks wrote into item.weights is the weighting. Either way the
    gradients hold sum(w * CE) and the step divides them by the global sum of the same w."""
    from model.objective import dpace_reweight
    return dpace_reweight(item.weights, item.rows, block_size, DPACE_ALPHA) if LOSS_WEIGHTING == "dpace" else None


def decay_weighted(parts, item):
    """(sum w * CE, sum w) under the exp decay of item.weights whatever LOSS_WEIGHTING is: the status line's loss,
    so runs with either weighting read on one scale."""
    if LOSS_WEIGHTING == "exp":
        return parts.loss_sum.detach(), parts.weight_sum
    w = item.weights.index_select(0, item.rows)                                              # [R]
    return (w * parts.ce).sum(), w.sum()


def load_frozen_io(path, device, dtype):
    """The target's embedding and lm_head weights only (drafter ranks never load the whole target)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig
    path = Path(path)
    top = AutoConfig.from_pretrained(path, local_files_only=True)
    cfg = top.get_text_config()
    tied = bool(getattr(top, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False))
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    found = {}
    for f in files:
        if not (path / f).exists():
            continue
        with safe_open(path / f, framework="pt") as sf:
            for k in sf.keys():
                if k.endswith("embed_tokens.weight") and "embed" not in found:
                    found["embed"] = sf.get_tensor(k)
                elif k == "lm_head.weight":
                    found["head"] = sf.get_tensor(k)
    if "embed" not in found or ("head" not in found and not tied):
        # not safetensors, or unusual names: let transformers find the two tensors
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        found = {"embed": m.get_input_embeddings().weight.detach(), "head": m.get_output_embeddings().weight.detach()}
    found.setdefault("head", found["embed"])                                             # tied embeddings
    embed = torch.nn.Embedding.from_pretrained(found["embed"].to(device, dtype), freeze=True)
    return embed, found["head"].to(device, dtype).requires_grad_(False), cfg


def fmt_eta(s):
    if not math.isfinite(s):
        return "?"
    return f"{s / 86400:.1f}d" if s >= 86400 else f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.0f}m" if s >= 60 \
        else f"{s:.0f}s"


def fmt_k(x):
    return f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


class Metrics:
    """metrics.jsonl (+ optional TensorBoard / W&B) on the master."""

    def __init__(self, out_dir, config):
        self.f = open(out_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = self.wandb = None
        if TENSORBOARD:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out_dir / "tb"))
        if WANDB_PROJECT:
            import wandb
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


# --- main -----------------------------------------------------------------------------------------------------------

def main(argv):
    config = parse_overrides(argv)
    resolve_paths()
    config.update(TARGET=TARGET, DATA=DATA)
    d = Dist()
    log(f"[rank {d.rank} {d.role}] {d}")
    from model import fp8
    errs = [e for name in ("TARGET_FP8", "DRAFTER_FP8") if globals()[name] and (e := fp8.check(name, d.device))]
    if errs:   # every rank checks, so the whole job stops here, before any model loads
        sys.exit("error: " + "; ".join(errs))

    import numpy as np
    import torch
    from transformers import AutoConfig, AutoTokenizer

    import checkpoint as ckpt
    from model.drafter import Drafter, DrafterConfig
    from model.target import check_mask_token_id, default_mask_token_id
    from pipe import Receiver, Sender, Watchdog

    out_dir = Path(OUT_DIR)
    ck_root = out_dir / "checkpoints"
    watchdog = None
    if not d.colocated:
        watchdog = Watchdog(d.store, d.rank, d.world, d.roles, HEARTBEAT_TIMEOUT, STALL_TIMEOUT, log=log,
                            is_master=d.is_master)
        watchdog.start()

    def fail(reason, detail=""):
        if watchdog:
            watchdog.fail(reason, detail)
        print(detail, file=sys.stderr)
        sys.exit(f"error: {reason}")

    stop_flag = threading.Event()

    first_signal = []

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        # the second one ends the job: the next step may never come (a stuck rank, a wait on input). One Ctrl-C
        # reaches a rank twice, from the terminal and forwarded by torchrun a moment later: that is still the first.
        if first_signal and time.monotonic() - first_signal[0] > SECOND_SIGNAL_S:
            fail(f"got a second {name}: ending now, without a checkpoint; RESUME=auto continues from the newest "
                 f"complete one in {ck_root}")
        if first_signal:
            return
        first_signal.append(time.monotonic())
        stop_flag.set()  # acted on at the next optimizer step boundary
        log(f"[rank {d.rank} {d.role}] got {name}: saving a checkpoint at the next step (send it again to end now)")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        # -- config that needs the target's config and tokenizer (no weights yet) --
        hf_cfg = AutoConfig.from_pretrained(TARGET, local_files_only=True).get_text_config()
        vocab_rows = hf_cfg.vocab_size
        try:
            tok = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
        except (OSError, ValueError):
            tok = None
        stats = read_stats(DATA)
        if tok is not None and stats:
            errs = check_data_tokenizer(stats, tok)
            if errs:
                sys.exit("error: DATA does not match TARGET:\n  - " + "\n  - ".join(errs))
        elif d.is_master and stats.get("tokenizer_hash"):
            log(f"NOTE: TARGET={TARGET} has no tokenizer: DATA's tokenizer ({stats.get('tokenizer')}) is not checked")
        eval_setup = eval_inputs(tok, stats) if EVAL_EVERY else None
        if eval_setup and d.is_master:
            log(f"eval: every {EVAL_EVERY} checkpoint(s), {len(eval_setup['prompts'])} prompts of {eval_setup['path']}, "
                f"thinking={stats.get('thinking') or 'the template default'} (as DATA was prepared)")
        mask_id = MASK_TOKEN_ID
        if mask_id < 0:
            if tok is None:
                sys.exit(f"error: TARGET={TARGET} has no tokenizer, so MASK_TOKEN_ID cannot be chosen: pass "
                         f"--MASK_TOKEN_ID=<an unused id below {vocab_rows}>")
            mask_id = default_mask_token_id(tok, vocab_rows)
        elif tok is not None:
            try:
                check_mask_token_id(mask_id, tok, vocab_rows)
            except ValueError as e:
                sys.exit(f"error: --MASK_TOKEN_ID={mask_id}: {e}. Leave --MASK_TOKEN_ID=-1 to use "
                         f"{default_mask_token_id(tok, vocab_rows)}, chosen automatically")
        elif not 0 <= mask_id < vocab_rows:
            sys.exit(f"error: MASK_TOKEN_ID={mask_id} is outside the target's embedding (0..{vocab_rows - 1})")
        layer_ids = [int(x) for x in TARGET_LAYER_IDS.split(",")] if TARGET_LAYER_IDS else None
        try:
            dcfg = DrafterConfig.from_target(hf_cfg, NUM_DRAFT_LAYERS, BLOCK_SIZE, mask_id, target_layer_ids=layer_ids,
                                             num_taps=NUM_TAPS or None, sliding_window_layers=SLIDING_WINDOW_LAYERS,
                                             sliding_window=SLIDING_WINDOW or None)
        except AssertionError as e:
            sys.exit(f"error: drafter config: {e}")
        config.update(MASK_TOKEN_ID=mask_id, TARGET_LAYER_IDS=",".join(map(str, dcfg.target_layer_ids)))
        init_notes = check_init_from(dcfg) if INIT_FROM else []   # before any model (or the data) loads

        with Phase(d, "load data", watchdog):
            data = Data(DATA, vocab_rows, BLOCK_SIZE)
        if d.device.type == "cuda":   # memory plan per role; refuse what cannot fit, naming the knob
            from planner import check_fits, estimate, format_plan
            gpu_mem = torch.cuda.get_device_properties(d.device).total_memory
            mplan = estimate({**config, "MAX_LEN": int(max(data.plan.lengths))}, hf_cfg, d.world, gpu_mem)
            if d.is_master:
                log(format_plan(mplan))
            d.mem_estimate = mplan["roles"][d.role]["total"]                  # read back by log_peak_memory
            errs = check_fits(mplan, gpu_mem)
            if errs:
                sys.exit("error: the config does not fit this GPU (planner.py):\n  - " + "\n  - ".join(errs))

        # -- where to start: checkpoint choice is made by the master and shared through the store --
        resume_path = None
        if d.is_master and not DRY_RUN:   # one job per OUT_DIR, from here to the process's exit
            try:
                ckpt.lock_out_dir(out_dir, log=log)
            except ckpt.CheckpointError as e:
                fail(str(e))
        if d.is_master:
            existing = ckpt.list_checkpoints(ck_root)
            if RESUME == "scratch" and existing:
                fail(f"RESUME=scratch but {ck_root} already holds checkpoints ({existing[-1].name}); nothing was "
                     f"overwritten. Use RESUME=auto to continue, or another OUT_DIR")
            elif RESUME == "auto":
                resume_path = ckpt.latest_complete(ck_root, log=log)
                if existing and resume_path is None:
                    log(f"WARNING: no complete checkpoint among {len(existing)} in {ck_root}: starting from scratch")
            elif RESUME != "scratch":
                try:
                    ckpt.verify(RESUME)
                except ckpt.CheckpointError as e:
                    fail(f"RESUME={RESUME}: {e}")
                resume_path = Path(RESUME)
            if d.store:
                d.store.set("resume_path", str(resume_path or ""))
        elif d.store:
            resume_path = d.store.get("resume_path").decode() or None
        meta = ckpt.read_meta(resume_path) if resume_path else None
        fingerprint = target_fingerprint(TARGET)
        if meta:   # what shapes the drafter, and the target it learned, must be the checkpoint's: else refuse now
            errs = resume_mismatches(meta, dcfg, fingerprint)
            if errs:
                fail(f"cannot resume {resume_path}: this run differs in what the checkpoint was trained for:\n  - "
                     + "\n  - ".join(errs) + "\nResume with the checkpoint's settings and TARGET, or start over in "
                     f"another OUT_DIR")
            if d.is_master and not meta.get("target"):
                log(f"WARNING: {resume_path} records no target fingerprint (written by an older version): the TARGET "
                    f"is not checked against it")
            elif d.is_master and meta["target"]["path"] != fingerprint["path"]:
                log(f"NOTE: TARGET moved since the checkpoint ({meta['target']['path']} -> {fingerprint['path']}); "
                    f"same config and weights")

        start_g, step, planned_g = 0, 0, None
        if meta:
            start_g, step = meta["next_g"], meta["step"]
            old = meta["data"]
            # the schedule's length stays the checkpoint's unless what defines it changed
            if (meta["config"].get("EPOCHS"), meta["config"].get("MAX_STEPS")) == (EPOCHS, MAX_STEPS):
                planned_g = meta.get("planned_g")
            elif d.is_master:
                log("NOTE: EPOCHS/MAX_STEPS changed since the checkpoint: the LR schedule is re-planned")
            if old["content_hash"] == data.content_hash and old["num_batches"] != data.plan.num_batches:
                # same data, other TOKEN_BUDGET / MAX_BATCH_SIZE: micro-batch numbers mean other batches now
                start_g = round(start_g / old["num_batches"] * data.plan.num_batches)
                planned_g = None
                if d.is_master:
                    log(f"NOTE: batching changed since the checkpoint ({old['num_batches']} -> "
                        f"{data.plan.num_batches} micro-batches/epoch): continuing at the same fraction of the data "
                        f"(micro-batch {start_g}), LR schedule re-planned")
            elif old["content_hash"] != data.content_hash:
                what = (f"dataset changed since {resume_path}: it had {old['rows']} rows / {old['num_batches']} "
                        f"micro-batches (hash {old['content_hash'][:12]}), now {data.num_rows} / "
                        f"{data.plan.num_batches} (hash {data.content_hash[:12]})")
                if not ALLOW_DATA_CHANGE:
                    fail(what + ". Set --ALLOW_DATA_CHANGE=True to continue on the new data (the LR schedule "
                                "is re-planned), or restore the old dataset")
                # same fraction of the run on the new data
                start_g = round(start_g / max(1, old["num_batches"]) * data.plan.num_batches)
                planned_g = None
                if d.is_master:
                    log(f"WARNING: {what}; ALLOW_DATA_CHANGE: continuing at micro-batch {start_g}, re-planned LR")
            if d.is_master:
                ck_env, env = meta.get("env", {}), ckpt.environment()
                for k in ("torch", "cuda", "transformers"):
                    if ck_env.get(k) != env.get(k):
                        log(f"WARNING: {k} version differs from the checkpoint's: {ck_env.get(k)} -> {env.get(k)}")
                if meta.get("split") != [d.n_targets, d.n_drafters]:
                    log(f"NOTE: checkpoint split {meta.get('split')} -> now {d.n_targets} targets : {d.n_drafters} "
                        f"drafters; continuing from the same data position (micro-batch {start_g})")
        sched = Schedule(data.plan.num_batches, d.n_targets, d.n_drafters, start_g, planned_g)
        total_steps = step + sched.steps

        if d.is_master:
            log("config: " + " ".join(f"{k}={v}" for k, v in config.items()))   # the final values, in every log
            ps = data.plan.stats()
            log(f"data: {data.num_rows:,} rows, {len(data.rows):,} trainable"
                + (f" (dropped {data.dropped})" if data.dropped else "")
                + f"; {data.plan.num_batches:,} micro-batches/epoch (mean {ps['mean_batch_size']:.1f} seqs, "
                  f"padding waste {ps['padding_waste']:.1%})")
            log(f"plan: {d.n_targets} target : {d.n_drafters} drafter ranks x GRAD_ACCUM={GRAD_ACCUM} => "
                f"{sched.per_step} micro-batches/step; {total_steps:,} steps ({sched.total_g:,} micro-batches, "
                f"{sched.total_g / data.plan.num_batches:.2f} epochs); drafter L={dcfg.num_hidden_layers} "
                f"taps={dcfg.target_layer_ids} B={dcfg.block_size} mask_token_id={mask_id}")
            if meta:
                log(f"RESUMING from step {step} of {resume_path} (micro-batch {start_g}, epoch~{start_g / data.plan.num_batches:.2f})")
                if INIT_FROM:
                    log(f"NOTE: INIT_FROM={INIT_FROM} is ignored: a checkpoint to resume wins (RESUME={RESUME}); "
                        f"use another OUT_DIR to start over from INIT_FROM")
            elif INIT_FROM:
                for note in init_notes:
                    log(note)
        if DRY_RUN:
            if d.is_master:
                log("DRY_RUN: config and data are fine; exiting before loading any model")
            finish(d, watchdog, code=0)

        if d.is_master:
            out_dir.mkdir(parents=True, exist_ok=True)
            run_info = {"config": config, "env": ckpt.environment(), "world": d.world, "split": [d.n_targets, d.n_drafters],
                        "drafter": dcfg.__dict__, "data": {"rows": data.num_rows, "trainable": len(data.rows),
                                                           "dropped": data.dropped, "content_hash": data.content_hash,
                                                           "num_batches": data.plan.num_batches},
                        "target": fingerprint, "resumed_from": str(resume_path) if resume_path else None,
                        "time": time.time()}
            (out_dir / "run.json").write_text(json.dumps(run_info, indent=1, default=str))

        stop_g = [sched.total_g]

        def current_stop_g():
            if d.store and d.store.check(["stop_g"]):
                stop_g[0] = int(d.store.get("stop_g"))
            return stop_g[0]

        # -- target rank --
        target = None
        if d.is_target:
            from model.target import Target
            with Phase(d, f"load target {TARGET}", watchdog):
                target = Target(TARGET, d.device, d.dtype, dcfg.target_layer_ids)
            if TARGET_FP8:   # before compiling: the compiled layers then fuse the activations' FP8 casts
                log(f"[rank {d.rank} {d.role}] TARGET_FP8: {fp8.quantize_target(target)} Linear layers of target "
                    f"layers 0..{max(dcfg.target_layer_ids)} in FP8 (per-row scales)")
            if COMPILE_TARGET:
                target.compile_layers()   # a target rank compiles at its first forward, on this (the main) thread
            if COMPILE_TARGET and d.colocated:
                # The one process runs its target forward on the feeder thread (its own CUDA stream, so it overlaps
                # the drafter step, and HF's host syncs stall the feeder, not the thread that launches the drafter).
                # Dynamo would compile there at the first micro-batch, while the main thread compiles the drafter:
                # instead every graph is made here, before the feeder starts, so it only runs them.
                with Phase(d, "compile the target (main thread, before the feeder thread)", watchdog):
                    target.warm_up(TOKEN_BUDGET)
        if d.is_target and not d.colocated:
            sender = Sender(d.ctrl, d.data, SEND_DEPTH, watchdog)
            sender.start()
            clock = BusyClock(d.device)
            watchdog.collect.append(clock.poll)
            watchdog.steady = True
            watchdog.state = "producing"
            n0 = 0
            for p in produce(d, data, sched, target, start_g, current_stop_g, watchdog, clock):
                sender.put(d.n_targets + sched.consumer(p.g), p)
                watchdog.progress()
                n0 += 1
                watchdog.stats.update(n=n0, tok=sender.tokens, q=watchdog.stats.get("q", 0))
            watchdog.state = "all micro-batches produced; waiting for the drafters to finish"
            log_peak_memory(d)
            wait_done(d, watchdog)

        # -- drafter rank (or the single process) --
        with Phase(d, "build drafter", watchdog):
            torch.manual_seed(SEED)
            drafter = Drafter(dcfg).to(d.device)                      # fp32 master weights
            if DRAFTER_FP8:   # the same parameters in other modules: before the optimizer and the compile
                log(f"[rank {d.rank} {d.role}] DRAFTER_FP8: {fp8.convert_drafter(drafter)} Linear layers train in FP8 "
                    f"(rowwise); fc and the lm_head stay bf16" + ("" if COMPILE_DRAFTER == "layers" else
                                                                  "; meant with COMPILE_DRAFTER=layers, which fuses "
                                                                  "its casts"))
            embed, head_w, _ = load_frozen_io(TARGET, d.device, d.dtype) if target is None else \
                (target.embed_tokens, target.lm_head_weight, None)
            params = [p for p in drafter.parameters()]
            from optim import make_optimizer
            opt = make_optimizer(drafter, LR, WEIGHT_DECAY, overlap=OVERLAP_OPTIMIZER)
            if resume_path:
                state = ckpt.load_state(resume_path, map_location=d.device)
                drafter.load_state_dict(state["drafter"])
                try:
                    opt.load_state_dict(state["optimizer"])
                except ValueError as e:
                    raise SystemExit(f"error: the optimizer state in {resume_path} does not match this drafter's "
                                     f"parameters ({e}); it was written for another drafter shape "
                                     f"(NUM_DRAFT_LAYERS, TARGET_LAYER_IDS or the target). Resume with the settings "
                                     f"that wrote it, or start over in another OUT_DIR") from e
                torch.set_rng_state(state["rng"]["torch"].cpu())
                random.setstate(state["rng"]["python"])
                np.random.set_state(state["rng"]["numpy"])
            elif INIT_FROM:
                dtype = load_init_from(drafter)
                if d.is_master:
                    log(f"INIT_FROM: drafter weights from {INIT_FROM} ({dtype} export, into float32 master weights); "
                        f"a fresh run: step 0, new optimizer, the LR schedule from its start")
            model = drafter
            if COMPILE_DRAFTER != "off":
                from model.drafter import compile_drafter
                compile_drafter(drafter, COMPILE_DRAFTER)   # compiled by the first step, on this (the main) thread
            if d.n_drafters > 1:
                from torch.nn.parallel import DistributedDataParallel as DDP
                model = DDP(drafter, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                            process_group=d.drafters)
        if d.flex:
            from model.attention import set_flex_kernel_options, warmup_flex_attention
            set_flex_kernel_options(json.loads(FLEX_OPTIONS) if FLEX_OPTIONS else None)
            with Phase(d, "compile flex_attention (main thread, before worker threads)", watchdog):
                warmup_flex_attention(d.device, d.dtype, dcfg.num_attention_heads, dcfg.num_key_value_heads,
                                      dcfg.head_dim, dcfg.block_size, mask_lengths(dcfg, d.device, d.flex))
        prepare = make_prepare(dcfg, d.device, d.flex)
        if d.colocated:
            next_item = colocated_feed(d, data, sched, target, start_g, current_stop_g, prepare)
        else:
            schedule = ((g, sched.producer(g)) for g in sched.drafter_gs(d.drafter_index))
            receiver = Receiver(schedule, d.ctrl, d.data, d.device, Q_HS, watchdog, prepare)
            receiver.start()
            next_item = receiver.get
            watchdog.state = "waiting for the first micro-batch (queues filling)"
        train(d, dcfg, model, drafter, opt, embed, head_w, sched, data, step, total_steps, config,
              ck_root, watchdog, stop_flag, next_item, receiver if not d.colocated else None, eval_setup)
        log_peak_memory(d)
        finish(d, watchdog, code=0)
    except SystemExit as e:
        if e.code not in (0, None):
            msg = str(e.code)
            if watchdog:
                watchdog.fail(msg.removeprefix("error: "))
            raise
        raise
    except Exception as e:  # noqa: BLE001 - every failure ends the whole job with a reason
        reason = f"{type(e).__name__}: {e}"
        if "out of memory" in str(e).lower() and torch.cuda.is_available():
            gib = 2 ** 30
            reason = (f"CUDA out of memory on {d.device}: {torch.cuda.memory_allocated() / gib:.1f} GiB allocated, "
                      f"{torch.cuda.memory_reserved() / gib:.1f} GiB reserved of "
                      f"{torch.cuda.get_device_properties(d.device).total_memory / gib:.1f} GiB. Lower MAX_ANCHORS "
                      f"(now {MAX_ANCHORS}), TOKEN_BUDGET (now {TOKEN_BUDGET}) or MAX_BATCH_SIZE (now {MAX_BATCH_SIZE})")
        fail(reason, traceback.format_exc())


def report_split(peers, d, row) -> bool:
    """Once every rank has computed a few micro-batches: each role's measured capacity (tokens per busy second per
    GPU) and the split planner.recommend_split gives for this many GPUs. Returns whether it could report."""
    from planner import recommend_split
    rates = {}
    for r, info in peers.items():
        if not info or info.get("busy_tok", 0) < 5 * TOKEN_BUDGET // 2 or info.get("busy_s", 0) <= 0:
            return False
        rates.setdefault(d.roles[r], []).append(info["busy_tok"] / info["busy_s"])
    tgt, dft = (sum(v) / len(v) for v in (rates["target"], rates["drafter"]))
    best = recommend_split(tgt, dft, d.world)
    row.update(target_capacity_tok_s=tgt, drafter_capacity_tok_s=dft, recommended_split=list(best))
    advice = "keep it" if best == (d.n_targets, d.n_drafters) else f"try --TARGET_RANKS={best[0]} (resume keeps " \
                                                                   f"the data position)"
    log(f"throughput per GPU (measured while busy): target {fmt_k(tgt)}tok/s, drafter {fmt_k(dft)}tok/s -> for "
        f"{d.world} GPUs the planner recommends {best[0]} targets : {best[1]} drafters (now {d.n_targets} : "
        f"{d.n_drafters}; {advice})")
    return True


def wait_done(d, watchdog):
    """Non-master ranks idle here until the master has saved; their watchdog then exits them with code 0."""
    watchdog.state = "finished; waiting for the master's last checkpoint"
    while True:
        time.sleep(1)


def log_peak_memory(d):
    """A GPU rank's peak memory over the run, to read against the planner's estimate printed at the start."""
    import torch
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


def train(d, dcfg, model, drafter, opt, embed, head_w, sched, data, step, total_steps, config, ck_root,
          watchdog, stop_flag, next_item, receiver, eval_setup=None):
    import numpy as np
    import torch
    import torch.distributed as dist

    import checkpoint as ckpt
    from model.export import export_drafter
    from model.objective import block_metrics, weighted_ce

    out_dir = Path(OUT_DIR)
    fingerprint = target_fingerprint(TARGET)   # in every checkpoint: a resume checks its target against it
    metrics = Metrics(out_dir, config) if d.is_master else None
    if watchdog and metrics:
        watchdog.on_abort.append(metrics.flush)
    autocast = torch.autocast("cuda", dtype=d.dtype) if d.device.type == "cuda" and d.dtype != torch.float32 \
        else torch.autocast("cpu", enabled=False)
    sums = torch.zeros(8, device=d.device, dtype=torch.float64)  # since the last status line: exp-decay loss,
    #                              its weight, acc_num, acc_den, streak_num, streak_den, objective loss, its weight
    step_w = torch.zeros(1, device=d.device, dtype=torch.float64)  # loss weight of this optimizer step
    params = [p for p in drafter.parameters()]
    t_start = t_log = time.time()
    step_at_log, tokens_since, mb_since, noise_std = step, 0, 0, NOISE / math.sqrt(3)
    step0 = step

    def g_at(st):  # first micro-batch of optimizer step st (counted from the run's start step)
        return sched.g0 + (st - step0) * sched.per_step

    stop_at = None
    first = True
    tgt_n_prev = 0   # micro-batches the target ranks had made at the last status line
    clock = BusyClock(d.device)
    split_reported = d.colocated
    if watchdog:
        watchdog.collect.append(clock.poll)
    if d.is_master:
        log(f"[rank {d.rank} {d.role}] waiting for the first micro-batch (target warm-up, queues filling) ...")

    def save(step_now, g_now):
        opt.wait_all()   # the overlapped optimizer's last update has run (parameters and its state)
        state = {"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step_now, "next_g": g_now,
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}}
        meta = {"step": step_now, "next_g": g_now, "planned_g": sched.planned_g, "epoch": g_now / data.plan.num_batches,
                "split": [d.n_targets, d.n_drafters], "config": config, "env": ckpt.environment(),
                "data": {"rows": data.num_rows, "num_batches": data.plan.num_batches, "content_hash": data.content_hash},
                "drafter": dcfg.__dict__, "target": fingerprint, "time": time.time()}
        t = time.time()
        try:
            path = ckpt.save(ck_root, step_now, state, meta, lambda p: export_drafter(drafter, p), KEEP_LAST)
        except ckpt.CheckpointError as e:
            raise SystemExit(f"error: {e}")
        log(f"saved {path} ({time.time() - t:.1f}s)")
        saves[0] += 1
        if EVAL_EVERY and saves[0] % EVAL_EVERY == 0:
            evaluate_now(step_now)

    saves = [0]
    evaluator = {"reference": {}}   # greedy reference decodes, kept: they depend on the target and prompts only

    def evaluate_now(step_now):
        """tau of the current drafter on EVAL_PROMPTS, on this rank; peers wait at the next collective, targets keep
        filling the queues. The watchdog knows (its stall check pauses), and the HF target it loads in EVAL_DTYPE
        is freed afterwards (planner.py counts it in the drafter's peak)."""
        from eval_dflash import evaluate
        from transformers import AutoModelForCausalLM
        opt.wait_all()
        t = time.time()
        with watchdog.pause(f"evaluating tau at step {step_now}") if watchdog else contextlib.nullcontext():
            target_model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=getattr(torch, EVAL_DTYPE),
                                                                attn_implementation="sdpa",
                                                                local_files_only=True).to(d.device).eval()
            drafter.eval()
            with torch.no_grad():
                res = evaluate(target_model, eval_setup["tok"], drafter, eval_setup["prompts"],
                               max_new_tokens=EVAL_MAX_NEW_TOKENS, device=d.device, on_too_long="skip",
                               reference=evaluator["reference"], enable_thinking=eval_setup["enable_thinking"],
                               log=None)
            del target_model
            if d.device.type == "cuda":
                torch.cuda.empty_cache()   # give the evaluation's memory back to training
        drafter.train()
        last_eval.update(tau=res["tau"], lossless=res["lossless"])
        metrics.write({"time": time.time(), "step": step_now, "tau": res["tau"], "lossless": res["lossless"],
                       "tau_by_category": res.get("tau_by_category"), "tf_streak": res.get("tf_streak"),
                       "eval_s": time.time() - t})
        # tf_streak: the training streak measured on these prompts' greedy outputs. tau ~ 1 + tf_streak when serving
        # matches training; tf_streak far below the status line's streak = the drafter does not generalise to them
        tf = res.get("tf_streak")
        log(f"eval step {step_now}: tau={res['tau']:.2f} lossless={'yes' if res['lossless'] else 'no'} "
            f"prompts={len(eval_setup['prompts'])} held-out streak={'-' if tf is None else f'{tf:.2f}'} "
            f"({time.time() - t:.0f}s)")

    last_eval = {}

    while step < total_steps:
        lr = sched.lr(g_at(step))
        for group in opt.param_groups:
            group["lr"] = lr
        for m in range(GRAD_ACCUM):
            item = next_item()
            if first:
                first = False
                if watchdog:
                    watchdog.steady = True
                if d.is_master:
                    log(f"[rank {d.rank} {d.role}] first micro-batch after {time.time() - t_start:.1f}s; training")
                t_start = t_log = time.time()
                if d.is_master and watchdog:
                    tgt_n_prev = sum((s or {}).get("n", 0) for s in watchdog.peer_states(range(d.n_targets)).values())
            if watchdog:
                watchdog.state = f"training step {step + 1} micro-batch g={item.g}"
            feats = item.features
            if NOISE:
                gen = torch.Generator(device=d.device).manual_seed(micro_seed(item.g))
                feats = feats + (torch.rand(feats.shape, generator=gen, device=d.device, dtype=torch.float32)
                                 * 2 - 1).mul_(NOISE).to(feats.dtype)
            t0 = clock.start()
            sync = m == GRAD_ACCUM - 1 or d.n_drafters == 1
            ctx = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
            with ctx, autocast:
                hidden = model(feats, item.ctx_pos, embed(item.block_ids), item.block_pos, item.attn)   # [N*B, H]
                parts = weighted_ce(hidden, head_w, item.labels, item.weights, CE_CHUNK, rows=item.rows,
                                    reweight=loss_reweight(item, dcfg.block_size))
                parts.loss_sum.backward()
            if m < GRAD_ACCUM - 1:
                clock.stop(t0, item.tokens)
            else:                                      # the step's last micro-batch: its busy time ends after the
                last_unit = (t0, item.tokens)          # optimizer, which is part of the drafter's per-step cost
            bm = block_metrics(parts.correct.view(-1, dcfg.block_size), item.weights.view(-1, dcfg.block_size))
            step_w += parts.weight_sum.double()
            sums += torch.stack([*decay_weighted(parts, item), bm["acc_num"], bm["acc_den"], bm["streak_num"],
                                 bm["streak_den"], parts.loss_sum.detach(), parts.weight_sum]).double()
            if DUMP_BATCHES and item.g < DUMP_BATCHES:   # exactly what arrived, for checking the transport
                (out_dir / "dump").mkdir(parents=True, exist_ok=True)
                torch.save({"g": item.g, "rank": d.rank, "features": item.features.cpu(), "lengths": item.lengths,
                            "input_ids": item.input_ids}, out_dir / "dump" / f"g{item.g:06d}.pt")
            tokens_since += item.tokens
            mb_since += 1
            if watchdog:
                watchdog.progress()
                watchdog.stats.update(q=receiver.q.qsize(), n=watchdog.stats.get("n", 0) + 1,
                                      tok=watchdog.stats.get("tok", 0) + item.tokens)
        # global normalisation: gradients hold sum(w * CE) (averaged by DDP over ranks); divide by the global weight
        if d.n_drafters > 1:
            dist.all_reduce(step_w, group=d.drafters)
        scale_clip_(params, (d.n_drafters / step_w.clamp(min=1e-12)).float(), GRAD_CLIP, opt)
        opt.step()
        clock.stop(*last_unit)
        opt.zero_grad(set_to_none=True)
        step_w.zero_()
        step += 1

        # -- stop requests: a signal on any rank -> every drafter stops after the same step --
        if d.store:
            if stop_flag.is_set() and not d.store.check(["stop_request"]):
                d.store.set("stop_request", str(d.rank))
            if d.is_master and stop_at is None and d.store.check(["stop_request"]):
                stop_at = step + 1
                d.store.set("stop_at", str(stop_at))
                d.store.set("stop_g", str(g_at(stop_at)))
            if stop_at is None and d.store.check(["stop_at"]):
                stop_at = int(d.store.get("stop_at"))
        elif stop_flag.is_set() and stop_at is None:
            stop_at = step
        stopping = stop_at is not None and step >= stop_at

        # -- status line --
        now = time.time()
        log_now = step - step_at_log >= LOG_EVERY or now - t_log >= LOG_SECONDS or step == total_steps or stopping
        if d.n_drafters > 1:   # every drafter must join the metric all-reduce: agree on when via the step count
            log_now = step % LOG_EVERY == 0 or step == total_steps or stopping
        if log_now:
            red = sums.clone()
            spread = 0.0
            if d.n_drafters > 1:
                dist.all_reduce(red, group=d.drafters)
                # DDP keeps drafters bitwise identical; check it where we sync anyway
                opt.wait_all()
                cs = torch.stack([p.detach().double().sum() for p in params]).sum()
                mm = torch.stack([cs, -cs])
                dist.all_reduce(mm, op=dist.ReduceOp.MAX, group=d.drafters)
                spread = float(mm[0] + mm[1])
                if spread != 0.0:
                    raise RuntimeError(f"drafter ranks hold different weights after step {step} (checksum spread "
                                       f"{spread:g}): DDP gradient sync is broken")
            loss, wt, an, ad, sn, sd, obj, obj_w = red.tolist()
            sums.zero_()
            if d.is_master:
                dt = max(1e-9, now - t_log)
                peers = watchdog.peer_states() if watchdog else {}
                tgt_n = sum((peers.get(r) or {}).get("n", 0) for r in range(d.n_targets))
                q_pre, q_hs = next_item.queues() if d.colocated else \
                    ([(peers.get(r) or {}).get("q", 0) for r in range(d.n_targets)],
                     [(peers.get(r) or {}).get("q", 0) for r in range(d.n_targets, d.world)])
                tgt_rate = (tgt_n - tgt_n_prev) / dt if not d.colocated else mb_since / dt
                tgt_n_prev = tgt_n
                dft_rate = mb_since * d.n_drafters / dt
                tok_rate = tokens_since * d.n_drafters / dt
                steps_done = step - step_at_log
                eta = (total_steps - step) * dt / max(1, steps_done)
                epoch = g_at(step) / data.plan.num_batches
                row = {"time": now, "elapsed_s": now - t_start, "step": step, "total_steps": total_steps,
                       "loss": loss / max(wt, 1e-12), "objective": obj / max(obj_w, 1e-12), "acc": an / max(ad, 1),
                       "streak": sn / max(sd, 1),
                       "lr": lr, "noise_std": noise_std, "tgt_mb_s": tgt_rate, "dft_mb_s": dft_rate,
                       "tok_s": tok_rate, "q_pre": q_pre, "q_hs": q_hs, "epoch": epoch, "eta_s": eta,
                       "ddp_weight_spread": spread}
                if not split_reported:
                    split_reported = report_split(peers, d, row)
                metrics.write(row)
                el = now - t_start
                tau = f" tau={last_eval['tau']:.2f}" if last_eval else ""
                dpace = f" dpace={row['objective']:.3f}" if LOSS_WEIGHTING == "dpace" else ""
                log(f"[{el / 60:.0f}m] step={step}/{total_steps} loss={row['loss']:.3f}{dpace} acc={row['acc']:.3f} "
                    f"streak={row['streak']:.2f}{tau} lr={lr:.1e} noise={noise_std:.3f} | tgt={tgt_rate:.2f}b/s "
                    f"dft={dft_rate:.2f}b/s ({fmt_k(tok_rate)}tok/s) | q_pre={q_pre} q_hs={q_hs} | "
                    f"epoch~{epoch:.2f} ETA={fmt_eta(eta)}")
            t_log, step_at_log, tokens_since, mb_since = now, step, 0, 0

        if d.is_master and (step % SAVE_EVERY == 0 or step == total_steps or stopping):
            if watchdog:
                watchdog.state = f"saving checkpoint step {step}"
            t_pause = time.time()
            save(step, g_at(step))
            t_log += time.time() - t_pause   # checkpoint and evaluation time is not training throughput
        if stopping:
            if d.is_master:
                log(f"stopped at step {step} on request; resume with RESUME=auto")
            break
    opt.wait_all()
    if d.is_master:
        if step >= total_steps:
            log(f"done: {step} steps; final drafter in {ckpt.step_dir(ck_root, step) / 'drafter'}")
        metrics.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
