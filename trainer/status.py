"""What a run prints and records: `log` (one write per line), start-up `Phase`s, the status line (`status_line`,
all-reduced over the drafter ranks at the log interval, with its `Meter`), metrics.jsonl and the optional trackers
(`Metrics`, `check_trackers`), the measured target:drafter split and the peak memory."""
import json
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.drafters import ARCHS
from trainer import planner
from trainer.pipe import BusyClock
from trainer.micro_batch import MicroBatchSums

WANDB_ID_FILE = "wandb_run_id.txt"   # in OUT_DIR: the W&B run a resume continues


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


def log_plan(d, c, given, data, sched, dcfg, step, total_steps, resume_path, init_notes):
    """The master's start-up summary: the final settings c (in every log), the data, the split and the schedule,
    where the run starts, and notes on settings given (`given`: on the command line) that this run does not use."""
    log("config: " + " ".join(f"{k}={v}" for k, v in c.as_dict().items()))
    ps = data.plan.stats()
    log(f"data: {data.num_rows:,} rows, {len(data.rows):,} trainable"
        + (f" (dropped {data.dropped})" if data.dropped else "")
        + f"; {data.plan.num_batches:,} micro-batches/epoch (mean {ps['mean_batch_size']:.1f} seqs, "
          f"padding waste {ps['padding_waste']:.1%})")
    replicas = f" ({d.n_replicas} target replica{'s' if d.n_replicas > 1 else ''} x TARGET_SHARDS={d.shards}, " \
        f"each rank forwarding its own micro-batches)" if d.shards > 1 else ""
    log(f"plan: {d.n_targets} target : {d.n_drafters} drafter ranks{replicas} x GRAD_ACCUM={c.GRAD_ACCUM} => "
        f"{sched.per_step} micro-batches/step; {total_steps:,} steps ({sched.total_g:,} micro-batches, "
        f"{sched.total_g / data.plan.num_batches:.2f} epochs); drafter L={dcfg.num_hidden_layers} "
        f"taps={dcfg.target_layer_ids} B={dcfg.block_size} mask_token_id={dcfg.mask_token_id}")
    if resume_path:
        log(f"RESUMING from step {step} of {resume_path} (micro-batch {sched.g0}, "
            f"epoch~{sched.g0 / data.plan.num_batches:.2f})")
        if c.INIT_FROM:
            log(f"NOTE: INIT_FROM={c.INIT_FROM} is ignored: a checkpoint to resume wins (RESUME={c.RESUME}); "
                f"use another OUT_DIR to start over from INIT_FROM")
    elif c.INIT_FROM:
        for note in init_notes:
            log(note)
    if "GAMMA" in given and c.LOSS_WEIGHTING == "dpace":
        log(f"NOTE: GAMMA={c.GAMMA} is not used: LOSS_WEIGHTING=dpace weighs a block's slots by the drafter's own "
            f"confidence (DPACE_ALPHA is its setting); GAMMA is the decay of LOSS_WEIGHTING=exp")


# --- the status line -------------------------------------------------------------------------------------------

@dataclass
class Meter:
    """The status line's sums and counters since the last one."""
    sums: torch.Tensor             # [len(MicroBatchSums._fields)] float64: MicroBatchSums of the micro-batches since, stacked
    t_start: float
    t_log: float
    step_at_log: int
    tokens: int = 0
    micro_batches: int = 0
    tgt_n_prev: int = 0            # micro-batches the target ranks had made at the last status line
    split_reported: bool = False
    run_tokens: int = 0            # this rank's tokens over the whole run (the split report's wait needs them)


def status_line(run, meter, params, lr, now):
    """The metrics since the last line, all-reduced over the drafters (every drafter calls this at the same step),
    then on the master one line and one metrics.jsonl row. Also checks that DDP kept the drafters identical (FSDP2's
    ranks hold different shards: ddp_weight_spread is null)."""
    d, step, c = run.d, run.step, run.c
    red = meter.sums.clone()
    spread = 0.0 if c.DRAFTER_SHARDING == "ddp" else None
    if d.n_drafters > 1:
        dist.all_reduce(red, group=d.drafters)
    if d.n_drafters > 1 and c.DRAFTER_SHARDING == "ddp":
        # DDP keeps drafters bitwise identical; check it where we sync anyway
        run.opt.wait_all()
        cs = torch.stack([p.detach().double().sum() for p in params]).sum()
        mm = torch.stack([cs, -cs])
        dist.all_reduce(mm, op=dist.ReduceOp.MAX, group=d.drafters)
        spread = float(mm[0] + mm[1])
        if spread != 0.0:
            raise RuntimeError(f"drafter ranks hold different weights after step {step} (checksum spread "
                               f"{spread:g}): DDP gradient sync is broken")
    s = MicroBatchSums(*red.tolist())   # floats now: the one device-to-host copy of the interval
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
        noise_std = c.NOISE / math.sqrt(3)
        row = {"time": now, "elapsed_s": now - meter.t_start, "step": step, "total_steps": run.total_steps,
               "loss": s.loss / max(s.loss_w, 1e-12), "objective": s.objective / max(s.objective_w, 1e-12),
               "acc": s.acc_num / max(s.acc_den, 1), "streak": s.streak_num / max(s.streak_den, 1),
               "lr": lr, "noise_std": noise_std, "tgt_mb_s": tgt_rate, "dft_mb_s": dft_rate,
               "tok_s": tok_rate, "q_pre": q_pre, "q_hs": q_hs, "epoch": epoch, "eta_s": eta,
               "ddp_weight_spread": spread}
        arch = ARCHS[c.DRAFTER_ARCH]   # its own figures from its metrics' sums (Arch.status), after streak
        shown = arch.status(s.arch_sums(arch.metrics))
        row.update({name: v for name, (v, _) in shown.items()})
        if not meter.split_reported:
            meter.split_reported = report_split(peers, d, row, c.TOKEN_BUDGET)
            # enough work for this rank's clock to count (past its skipped first units), so the wait can succeed
            enough = meter.run_tokens >= split_min_tokens(c.TOKEN_BUDGET) + BusyClock.SKIP * c.TOKEN_BUDGET
            if not meter.split_reported and step == run.total_steps and enough and run.watchdog:
                # a run shorter than a few heartbeats: the peers' busy clocks arrive with their next beats. A pause:
                # this wait makes no progress, and a short STALL_TIMEOUT must not take it for a stall
                with run.watchdog.pause("waiting for the peers' busy clocks (the split report)"):
                    end = time.monotonic() + 3 * run.watchdog.interval
                    while not meter.split_reported and time.monotonic() < end:
                        time.sleep(0.2)
                        meter.split_reported = report_split(run.watchdog.peer_states(), d, row, c.TOKEN_BUDGET)
        run.metrics.write(row)
        tau = f" tau={run.last_eval['tau']:.2f}" if run.last_eval else ""
        dpace = f" dpace={row['objective']:.3f}" if c.LOSS_WEIGHTING == "dpace" else ""
        own = "".join(f" {name}={v:{fmt}}" for name, (v, fmt) in shown.items())
        log(f"[{(now - meter.t_start) / 60:.0f}m] step={step}/{run.total_steps} loss={row['loss']:.3f}{dpace} "
            f"acc={row['acc']:.3f} streak={row['streak']:.2f}{own}{tau} lr={lr:.1e} noise={noise_std:.3f} | "
            f"tgt={tgt_rate:.2f}b/s dft={dft_rate:.2f}b/s ({fmt_k(tok_rate)}tok/s) | "
            f"q_pre={fmt_q_pre(q_pre, d.shards)} q_hs={q_hs} | "
            f"epoch~{epoch:.2f} ETA={fmt_eta(eta)}")
    meter.t_log, meter.step_at_log, meter.tokens, meter.micro_batches = now, step, 0, 0


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


# --- metrics.jsonl and trackers ----------------------------------------------------------------------------------

class Metrics:
    """metrics.jsonl (+ optional TensorBoard / W&B, check_trackers) on the master. The W&B run's id is kept in
    OUT_DIR/wandb_run_id.txt, so a resumed run continues the same W&B run."""

    def __init__(self, out_dir, c):
        self.f = open(out_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = self.wandb = None
        if c.TENSORBOARD:
            from torch.utils.tensorboard import SummaryWriter   # optional package (check_trackers)
            self.tb = SummaryWriter(str(out_dir / "tb"))
        if c.WANDB_PROJECT:
            import wandb   # optional package (check_trackers)
            id_file = out_dir / WANDB_ID_FILE
            run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
            id_file.write_text(run_id + "\n")
            self.wandb = wandb.init(project=c.WANDB_PROJECT, config=c.as_dict(), dir=str(out_dir), id=run_id,
                                    resume="allow")

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


def check_trackers(tensorboard: bool, wandb_project: str) -> list[str]:
    """TENSORBOARD / WANDB_PROJECT's optional packages, imported at start-up (before any model loads) so a missing
    one is an error then, not after the target loaded. -> the errors."""
    errs = []
    if tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            errs.append(f"TENSORBOARD=True needs the tensorboard package ({e}): pip install tensorboard, or set "
                        f"--TENSORBOARD=False")
    if wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError as e:
            errs.append(f"WANDB_PROJECT={wandb_project} needs the wandb package ({e}): pip install wandb, or set "
                        f'--WANDB_PROJECT=""')
    return errs


# --- measurements ----------------------------------------------------------------------------------------------

def split_min_tokens(token_budget) -> int:
    """Busy tokens a rank's clock must hold before its rate counts for the split report: ~2.5 micro-batches."""
    return 5 * token_budget // 2


def measured_enough(clock: dict, token_budget) -> bool:
    """A peer's heartbeat carries a BusyClock with enough work for a rate."""
    return bool(clock) and clock.get("busy_tok", 0) >= split_min_tokens(token_budget) and clock.get("busy_s", 0) > 0


def report_split(peers, d, row, token_budget) -> bool:
    """Once every rank has computed a few micro-batches: each role's measured capacity (tokens per busy second per
    GPU) and the split planner.recommend_split gives for this many GPUs. Returns whether it could report."""
    rates = {}
    for r, info in peers.items():
        if not measured_enough(info, token_budget):
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
