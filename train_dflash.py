"""Train a DFlash drafter in one torchrun job: target ranks run the frozen target and stream hidden states to
drafter ranks, which train the drafter with DDP among themselves (or shard it with FSDP2: DRAFTER_SHARDING). No
external services. The algorithm:
docs/ALGORITHM.md; the route of a micro-batch and the role of each file: ARCHITECTURE.md.

    bash launch.sh                                                     # the usual way (tmux, log, allocator)
    torchrun --nproc-per-node 8 train_dflash.py --TARGET=/models/Qwen3-8B --DATA=/data/prepared --TARGET_RANKS=5
    python train_dflash.py --MAX_STEPS=20                              # one process: target and drafter in turn
    python train_dflash.py --help                                      # the constants below, grouped, with comments

Every constant below can be overridden as --NAME=VALUE (trainer/settings.py checks them). The final values are printed,
saved in OUT_DIR/run.json and in every checkpoint.
"""
import contextlib
import functools
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import eval_dflash
from data.loader import Data, DataError, Schedule, read_stats, tokenizer_mismatches
from model import fp8
from model.attention import set_flex_kernel_options, warmup_flex_attention
from model.drafter import Drafter, DrafterConfig, compile_drafter
from model.export import export_drafter
from model.target import Target, load_frozen_io
from trainer import checkpoint as ckpt
from trainer import planner
from trainer import settings
from trainer.drafter_step import StepConfig, autocast_for, drafter_step, make_prepare, mask_lengths, optimizer_step
from trainer.optim import lr_at, make_optimizer
from trainer.pipe import BusyClock, Prefetcher, Replica, Sender, StopPoint, TargetAhead, produce, receive
from trainer.status import Metrics, Meter, Phase, check_trackers, log, log_peak_memory, log_plan, status_line
from trainer.watchdog import Watchdog, fail, finish, on_signals, wait_done

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
                            # 1K tokens at TOKEN_BUDGET 16384 (BENCHMARKS.md: anchor density at equal GPU time).
                            # SpecForge's num_anchors counts per sequence: MAX_ANCHORS = it x sequences per batch
MIN_ANCHORS_PER_DOC = 1     # floor per sequence when MAX_ANCHORS binds, so short sequences are not starved
GAMMA = 7.0                 # LOSS_WEIGHTING=exp: weight of slot k is exp(-(k-1)/GAMMA); 7 for B=16, 10 for B=32
LOSS_WEIGHTING = "dpace"    # dpace (D-PACE, vLLM speculators' default; +0.10 tau over exp, BENCHMARKS.md)
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
                            # tau within noise; slower at small hidden sizes (BENCHMARKS.md, throughput)
DRAFTER_FP8_RECIPE = "rowwise_with_gw_hp"   # | rowwise | tensorwise: torchao's recipes (model/fp8.py)
HEAD_FP8 = False            # the loss's two lm_head GEMMs (logits, input gradient) in FP8, per-row scales (SM89+)
DRAFTER_SHARDING = "ddp"    # ddp (every drafter rank holds all weights, grads, AdamW) | fsdp (FSDP2: 1/D of each)
FLEX_OPTIONS = ""           # JSON kernel_options of the drafter's flex_attention, '{"USE_TMA": true}'; "" = torch's
OVERLAP_OPTIMIZER = True    # GPU: AdamW on a side stream, layer by layer, under the next forward (trainer/optim.py)
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
EVAL_PROMPTS = ""           # prompts JSONL for it ("" = data/default/eval_broad.jsonl, ten categories of traffic)
EVAL_LIMIT = 20             # prompts per evaluation, dealt over the categories (20 = 2 of each of the broad set's 10)
EVAL_MAX_NEW_TOKENS = 128   # tokens generated per prompt
EVAL_DTYPE = "float32"      # target dtype for it: float32 keeps the losslessness check exact (bf16 block vs
#                             one-token forwards round differently, which can flip near-tied greedy tokens)
TENSORBOARD = False         # also log to OUT_DIR/tb
WANDB_PROJECT = ""          # also log to this W&B project ("" = off)
DRY_RUN = False             # check the config and data, print the plan, exit before loading any model
DUMP_BATCHES = 0            # drafters save the first N received micro-batches to OUT_DIR/dump/ (debugging, tests)

CONFIG_KEYS = [k for k in list(globals()) if k.isupper() and not k.startswith("_") and k not in _IMPORTED]
REPO = Path(__file__).resolve().parent


# --- configuration ----------------------------------------------------------------------------------------------------

def constants() -> SimpleNamespace:
    """The constants above as they are now (after main's overrides), for trainer/settings.py's checks."""
    return SimpleNamespace(**{k: globals()[k] for k in CONFIG_KEYS})


def configure(argv) -> tuple[dict, set[str]]:
    """--NAME=VALUE overrides and the embedded defaults applied to the constants above (main, and launch.sh's check
    before it starts a job). -> (the run's settings, the names given on the command line)."""
    config, given = settings.parse_overrides(argv, {k: globals()[k] for k in CONFIG_KEYS}, Path(__file__))
    settings.resolve_paths(config)
    globals().update(config)   # the constants above now hold the run's values
    return config, given


def check_config(world: int) -> None:
    """settings.check_config on the constants as they are now (Dist runs it on every rank)."""
    settings.check_config(constants(), world)


def eval_inputs(tok, stats: dict) -> dict:
    """EVAL_EVERY's prompts (EVAL_LIMIT of them dealt over the categories: eval_dflash.load_prompts), checked at
    start-up (a bad row used to end the job at its first evaluation), and the dataset's thinking mode
    (data.prepare's stats.json), so the drafter is measured on prompts rendered as it was trained. tok: TARGET's
    tokenizer or None. -> {prompts, enable_thinking, path, tok}."""
    path = Path(EVAL_PROMPTS or REPO / "data" / "default" / "eval_broad.jsonl")
    thinking = stats.get("thinking")
    try:
        prompts = eval_dflash.load_prompts(path)
        for row in prompts:
            if "input_ids" not in row:
                eval_dflash.prompt_messages(row)
                if tok is None:
                    raise ValueError(f"prompt {row['id']!r} is text, and TARGET={TARGET} has no tokenizer to encode "
                                     f"it: give its rows as input_ids")
        # prompts TARGET's template will not render (a template without a system role, and the broad set's system
        # category) are left out, said once: the evaluation follows the run's progress on what the target can take
        if tok is not None and (refused := eval_dflash.refused_by_template(tok, prompts, {"on": True, "off": False}
                                                                              .get(thinking))):
            print(f"note: EVAL_PROMPTS: {eval_dflash.template_refusal_message(refused, prompts)}; the in-training "
                  f"evaluation leaves them out", flush=True)
            left_out = {r["id"] for r, _ in refused}
            prompts = [r for r in prompts if r["id"] not in left_out]
        prompts = eval_dflash.spread(prompts, EVAL_LIMIT) if EVAL_LIMIT else prompts
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        sys.exit(f"error: EVAL_PROMPTS={path}: {type(e).__name__ + ': ' if not isinstance(e, ValueError) else ''}{e}")
    if not prompts:
        sys.exit(f"error: EVAL_PROMPTS={path} holds no prompts the target can take (a JSONL of prompts, see "
                 f"eval_dflash.py)")
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


# --- main: the job's phases -------------------------------------------------------------------------------------------

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
    mask_id = settings.choose_mask_token_id(constants(), tok, hf_cfg.vocab_size)
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
            sys.exit("error: the config does not fit this GPU (trainer/planner.py):\n  - " + "\n  - ".join(errs))
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


def build_drafter(d, dcfg, target, resume_path, watchdog, step_cfg):
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
            dtype = settings.load_init_from(INIT_FROM, drafter)
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
                                  dcfg.head_dim, dcfg.block_size, mask_lengths(dcfg, d.device, d.flex, step_cfg))
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


def start_feed(d, data, sched, target, dcfg, watchdog, pre_stats, step_cfg):
    """The drafter side's Prefetcher: prepared micro-batches Q_HS ahead, from the network (a drafter rank) or from the
    target forward (the one process; its q_pre depth goes to pre_stats). The one process runs an eager target on
    the feeder thread, which launches its kernels beside the main thread's (a small target is launch-bound), and a
    compiled one on the main thread a micro-batch ahead (TargetAhead: compiled code must not run on one thread while
    another compiles)."""
    prep = make_prepare(dcfg, d.device, d.flex, step_cfg)
    if d.colocated:
        packets = produce(data, sched.target_gs(0), target, d.device, Q_PREFETCH, stats=pre_stats)
        if COMPILE_TARGET:
            log(f"[rank {d.rank} {d.role}] COMPILE_TARGET: the target forward runs on the main thread, a micro-batch "
                f"ahead of the step; the feeder thread prepares")
            feed = TargetAhead(packets, prep, d.device, Q_HS)
        else:
            feed = Prefetcher(packets, prep, d.device, Q_HS, name="feeder")
    else:
        schedule = ((g, sched.producer(g)) for g in sched.drafter_gs(d.drafter_index))
        packets = receive(schedule, d.ctrl, d.data, d.device, watchdog)
        feed = Prefetcher(packets, prep, d.device, Q_HS, name="receiver", fail=watchdog.fail)
        watchdog.state = "waiting for the first micro-batch (queues filling)"
    feed.start()
    return feed


def main(argv):
    config, given = configure(argv)
    step_cfg = StepConfig.of(config)
    d = Dist()
    log(f"[rank {d.rank} {d.role}] {d}")
    errs = [e for name in ("TARGET_FP8", "DRAFTER_FP8", "HEAD_FP8") if globals()[name] and
            (e := fp8.check(name, d.device))] + check_trackers(TENSORBOARD, WANDB_PROJECT)
    if errs:   # every rank checks, so the whole job stops here, before any model loads
        sys.exit("error: " + "; ".join(errs))
    out_dir, watchdog = Path(OUT_DIR), None
    ck_root = out_dir / "checkpoints"
    if not d.colocated:
        watchdog = Watchdog(d.store, d.rank, d.world, d.roles, HEARTBEAT_TIMEOUT, STALL_TIMEOUT, log=log,
                            is_master=d.is_master)
        watchdog.start()
    stop_flag = on_signals(f"[rank {d.rank} {d.role}]", watchdog, ck_root, log)
    try:
        # 1. settings that need the target's config and tokenizer, the data: all checked before any model loads
        dcfg, hf_cfg, eval_setup = drafter_config(d, config)
        init_notes = settings.check_init_from(constants(), dcfg) if INIT_FROM else []
        data = load_data(d, config, hf_cfg, watchdog)
        # 2. where to start
        resume_path = choose_resume(d, watchdog, out_dir, ck_root)
        fingerprint = ckpt.target_fingerprint(TARGET)
        rp = resume(d, watchdog, resume_path, config, data, dcfg, fingerprint)
        try:
            sched = Schedule(data.plan.num_batches, d.n_targets, d.n_drafters, GRAD_ACCUM, EPOCHS, MAX_STEPS,
                             rp.start_g, rp.planned_g)
        except DataError as e:
            sys.exit(f"error: {e}")
        total_steps = rp.step + sched.steps
        if d.is_master:
            log_plan(d, config, given, data, sched, dcfg, rp.step, total_steps, resume_path, init_notes)
        if DRY_RUN:
            if d.is_master:
                log("DRY_RUN: config and data are fine; exiting before loading any model")
            finish(d, watchdog, code=0)
        if d.is_master:
            ckpt.write_run_info(out_dir, config, d.world, [d.n_targets, d.n_drafters], data, dcfg, fingerprint,
                                resume_path)
        # 3. a target rank's job
        target = load_target(d, dcfg, watchdog) if d.is_target else None
        if d.is_target and not d.colocated:
            run_target(d, data, sched, target, watchdog)
        # 4. a drafter rank's (or the one process's) job
        drafter, model, opt, embed, head_w = build_drafter(d, dcfg, target, resume_path, watchdog, step_cfg)
        pre_stats = {}
        feed = start_feed(d, data, sched, target, dcfg, watchdog, pre_stats, step_cfg)
        train(Run(d=d, dcfg=dcfg, config=config, step_cfg=step_cfg, data=data, sched=sched, drafter=drafter,
                  model=model, opt=opt, embed=embed, head_w=head_w, feed=feed, pre_stats=pre_stats, watchdog=watchdog,
                  stop_flag=stop_flag, eval_setup=eval_setup, ck_root=ck_root, fingerprint=fingerprint, step=rp.step,
                  step0=rp.step, total_steps=total_steps))
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
                      f"(now {MAX_ANCHORS}), TOKEN_BUDGET (now {TOKEN_BUDGET}) or MAX_BATCH_SIZE (now "
                      f"{MAX_BATCH_SIZE})")
        fail(watchdog, reason, traceback.format_exc())


# --- the drafter loop -------------------------------------------------------------------------------------------------

@dataclass
class Run:
    """What the drafter loop reads and updates, built by main's phases."""
    d: Dist
    dcfg: DrafterConfig
    config: dict                   # the final settings, snapshotted into every checkpoint
    step_cfg: StepConfig           # the settings of a drafter step, from config
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
        lr = lr_at(run.g_at(run.step), run.sched.planned_g, LR, WARMUP_RATIO)
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
            sums = drafter_step(run.model, run.embed, run.head_w, item, B, autocast, run.step_cfg,
                                sync=m == GRAD_ACCUM - 1 or d.n_drafters == 1)
            if m < GRAD_ACCUM - 1:
                clock.stop(t0, item.tokens)
            else:                                      # the step's last micro-batch: its busy time ends after the
                last_unit = (t0, item.tokens)          # optimizer, which is part of the drafter's per-step cost
            step_w += sums.objective_w
            meter.sums += torch.stack(sums)
            micro_batch_done(run, meter, item)
        optimizer_step(params, run.opt, step_w, GRAD_CLIP, d.n_drafters, d.drafters)
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


def save_checkpoint(run):
    """The master's checkpoint after run.step (trainer/checkpoint.py's schema); every EVAL_EVERY-th one is evaluated just
    before it is written, so its export's model card carries that tau. DRAFTER_SHARDING=fsdp: every drafter rank calls it, writes its shard into the master's folder
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
    # every EVAL_EVERY-th checkpoint is evaluated before it is written, so its export's model card carries its tau
    ev = evaluate(run, run.drafter if not sharded else ckpt.whole_drafter(run.dcfg, full, d.device)) \
        if EVAL_EVERY and (run.saves + 1) % EVAL_EVERY == 0 else None
    card = dict(target=TARGET, target_fingerprint=run.fingerprint, step=run.step, data=run.data.fingerprint(),
                evaluation=ev)
    state = ckpt.train_state(run.drafter, run.opt, run.step, g, sharded=sharded)
    meta = ckpt.train_meta(run.step, g, run.sched.planned_g, [d.n_targets, d.n_drafters], run.config, run.data,
                           run.dcfg, run.fingerprint)
    t = time.time()
    try:
        path = ckpt.save(run.ck_root, run.step, state, meta,
                         lambda p: export_drafter(run.drafter, p, state=full, **card), KEEP_LAST, write_shards=shards)
    except ckpt.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    log(f"saved {path} ({time.time() - t:.1f}s)")
    run.saves += 1


def evaluate(run, drafter):
    """tau of the current drafter (run.drafter, or its whole copy when sharded) on EVAL_PROMPTS, on this rank; peers
    wait at the next collective, targets keep filling the queues. The watchdog knows (its stall check pauses), and
    the HF target it loads in EVAL_DTYPE is freed afterwards (trainer/planner.py counts it in the drafter's peak)."""
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
                       "tau_categories": res["tau_categories"], "tau_macro": res["tau_macro"],
                       "tau_macro_se": res["tau_macro_se"], "eval_s": time.time() - t})
    # tf_streak: the training streak measured on these prompts' greedy outputs. tau ~ 1 + tf_streak when serving
    # matches training; tf_streak far below the status line's streak = the drafter does not generalise to them
    tf = res.get("tf_streak")
    macro = "-" if res["tau_macro"] is None else f"{res['tau_macro']:.2f}"
    log(f"eval step {run.step}: tau={res['tau']:.2f} macro_tau={macro} ({len(res['tau_categories'])} categories) "
        f"lossless={'yes' if res['lossless'] else 'no'} "
        f"prompts={len(setup['prompts'])} held-out streak={'-' if tf is None else f'{tf:.2f}'} "
        f"({time.time() - t:.0f}s)")
    return dict(res, prompts_file=setup["path"].name)


if __name__ == "__main__":
    main(sys.argv[1:])
