"""trainer/settings.py: check_config's ranges, --NAME=VALUE and --help's text; the LR schedule. In-process (the
program's --help as a process: tests/jobs/test_config_jobs.py)."""
import math

import pytest
import torch

import train_dflash as td
from trainer import phases, settings
from data.loader import Schedule
from trainer.optim import lr_at


@pytest.fixture
def cfg(tiny_llama_dir, tmp_path, monkeypatch):
    """A valid configuration; set(NAME=value) changes it; check() returns check_config's error text ('' if ok)."""
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(td, "TARGET", str(tiny_llama_dir))
    monkeypatch.setattr(td, "DATA", str(tmp_path / "data"))
    monkeypatch.setattr(td, "OUT_DIR", str(tmp_path / "out"))

    class Cfg:
        @staticmethod
        def set(**kw):
            for k, v in kw.items():
                monkeypatch.setattr(td, k, v)

        @staticmethod
        def check():
            try:
                td.check_config(1)
            except SystemExit as e:
                return str(e.code)
            return ""
    return Cfg


def test_every_numeric_constant_has_a_range():
    numeric = [k for k in td.CONFIG_KEYS if isinstance(getattr(td, k), (int, float))
               and not isinstance(getattr(td, k), bool)]
    assert sorted(set(numeric) - set(settings.RANGES)) == [], \
        "open the new constant's comment with its allowed range, [>= N] or [> N]"
    assert all(settings.RANGES[k][0] <= getattr(td, k) for k in numeric), "a default outside its own range"


@pytest.mark.parametrize("name,value,message", [
    ("GRAD_CLIP", 0.0, "GRAD_CLIP=0.0 must be > 0 and finite"),
    ("GRAD_CLIP", -1.0, "GRAD_CLIP=-1.0 must be > 0"),
    ("GRAD_CLIP", math.inf, "GRAD_CLIP=inf must be > 0 and finite"),
    ("GAMMA", math.nan, "GAMMA=nan must be > 0 and finite"),
    ("LR", math.nan, "LR=nan must be > 0"),
    ("WEIGHT_DECAY", -0.1, "WEIGHT_DECAY=-0.1 must be >= 0"),
    ("NOISE", math.inf, "NOISE=inf must be >= 0 and finite"),
    ("SEED", -1, "SEED=-1 must be >= 0"),
    ("STALL_TIMEOUT", 0.0, "STALL_TIMEOUT=0.0 must be > 0"),
    ("MASK_TOKEN_ID", -2, "MASK_TOKEN_ID=-2 must be >= -1"),
    ("WARMUP_RATIO", 1.0, "WARMUP_RATIO=1.0 must be < 1"),
    ("DPACE_ALPHA", 1.5, "DPACE_ALPHA=1.5 must be <= 1"),
    ("SLIDING_WINDOW_LAYERS", 9, "SLIDING_WINDOW_LAYERS=9 must be <= NUM_DRAFT_LAYERS=5"),
])
def test_bad_numeric_values_are_refused(cfg, name, value, message):
    assert cfg.check() == ""
    cfg.set(**{name: value})
    assert message in cfg.check()


def test_unknown_drafter_fp8_recipe_is_refused_with_the_choices(cfg):
    cfg.set(DRAFTER_FP8_RECIPE="rowwise_fast")
    assert ("DRAFTER_FP8_RECIPE='rowwise_fast': allowed are rowwise_with_gw_hp, rowwise, tensorwise"
            in cfg.check())


def test_the_start_up_check_covers_the_device_fp8_and_trackers(cfg, monkeypatch):
    """check_config is the job's whole start-up check (launch.sh runs it too): DEVICE=cuda without CUDA, FP8 on a
    CPU, a tracker whose package is missing."""
    import builtins
    real = builtins.__import__

    def no_wandb(name, *a, **kw):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    cfg.set(WANDB_PROJECT="mine")
    assert "WANDB_PROJECT=mine needs the wandb package" in cfg.check()
    cfg.set(WANDB_PROJECT="", DEVICE="cpu", DRAFTER_FP8=True)
    assert "DRAFTER_FP8 needs an SM89+ GPU" in cfg.check()
    cfg.set(DRAFTER_FP8=False)
    assert cfg.check() == ""
    if not torch.cuda.is_available():
        cfg.set(DEVICE="cuda")
        assert "DEVICE=cuda but torch sees no CUDA device" in cfg.check()


def test_out_dir_that_is_a_file_and_target_without_weights(cfg, tiny_llama_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    cfg.set(OUT_DIR=str(tmp_path / "file"))
    assert f"OUT_DIR={tmp_path / 'file'} is a file, not a folder" in cfg.check()
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    cfg.set(OUT_DIR=str(tmp_path / "out"), TARGET=str(bare))
    assert f"TARGET={bare} has a config.json but no weights" in cfg.check()


@pytest.mark.parametrize("steps", [1, 2, 3, 10, 300])
@pytest.mark.parametrize("ratio", [0.0, 0.001, 0.04, 0.3, 0.999])
@pytest.mark.parametrize("per_step", [1, 3])
def test_lr_never_exceeds_the_peak(steps, ratio, per_step):
    s = Schedule(10_000, 1, 1, grad_accum=per_step, epochs=1, max_steps=steps)
    lrs = [lr_at(s.g0 + i * s.per_step, s.planned_g, td.LR, ratio) for i in range(s.steps)]
    assert max(lrs) <= td.LR, (max(lrs), td.LR)
    assert all(x >= 0 for x in lrs)
    if ratio * s.planned_g >= 2 * per_step:   # a real warmup: it rises, then the cosine falls
        assert lrs[0] < lrs[len(lrs) // 10 + 1] or lrs[0] < max(lrs)


def test_max_steps_is_the_run_length_whatever_the_epochs():
    """MAX_STEPS set: the run takes that many optimizer steps, the data repeating as often as needed (a 10-batch
    epoch, EPOCHS=1, 25 steps of 2 micro-batches = 5 passes); MAX_STEPS=0: EPOCHS passes."""
    s = Schedule(10, 1, 1, grad_accum=2, epochs=1, max_steps=25)
    assert (s.steps, s.planned_g) == (25, 50)
    s = Schedule(10, 1, 1, grad_accum=2, epochs=3, max_steps=0)
    assert (s.steps, s.planned_g) == (15, 30)


def test_overrides_set_typed_values_and_refuse_unknown_names():
    defaults = {"LR": 6e-4, "COMPILE_TARGET": False, "RESUME": "auto"}
    c, given = settings.parse_overrides(["--LR=1e-3", "--COMPILE_TARGET=yes"], defaults, td.REPO / "train_dflash.py")
    assert c == {"LR": 1e-3, "COMPILE_TARGET": True, "RESUME": "auto"} and given == {"LR", "COMPILE_TARGET"}
    assert defaults["LR"] == 6e-4                                     # the defaults are not changed
    with pytest.raises(SystemExit, match="unknown setting --LRR .*did you mean LR"):
        settings.parse_overrides(["--LRR=1"], defaults, td.REPO / "train_dflash.py")
    with pytest.raises(SystemExit, match="not a valid float"):
        settings.parse_overrides(["--LR=fast"], defaults, td.REPO / "train_dflash.py")


def test_help_lists_every_constant_with_its_comment_in_its_group():
    text = settings.help_text(td.REPO / "train_dflash.py")
    lines = text.splitlines()
    for k in td.CONFIG_KEYS:
        assert any(l.startswith(f"  --{k}=") for l in lines), f"--help lacks {k}"
    lr = next(l for l in lines if l.startswith("  --LR="))
    assert lr.split()[0] == "--LR=6e-4" and "peak learning rate" in lr
    groups = [l for l in lines if l.endswith(":") and not l.startswith(" ")]
    assert groups[:2] == ["what to train:", "objective:"], groups
    # a constant's continuation comment follows it
    anchors = lines.index(next(l for l in lines if l.startswith("  --MAX_ANCHORS=")))
    assert "1K tokens" in lines[anchors + 1]
    assert lines.index("optimisation:") < lines.index(next(l for l in lines if l.startswith("  --GRAD_CLIP=")))


def test_init_from_a_target_folder_says_it_is_not_a_drafter(tiny_qwen3_dir):
    """INIT_FROM pointed at a target (or any HF model folder) instead of an exported drafter: a message that says
    what the folder is and what INIT_FROM takes, not a KeyError from the config reader."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from model.drafter import DrafterConfig
    dcfg = DrafterConfig.from_target(AutoConfig.from_pretrained(tiny_qwen3_dir, local_files_only=True), 1, 4,
                                     mask_token_id=127)
    c = SimpleNamespace(INIT_FROM=str(tiny_qwen3_dir), TARGET=str(tiny_qwen3_dir))
    with pytest.raises(SystemExit, match=r"is not an exported drafter .*a target or other HF model folder\?\). "
                                         r"INIT_FROM takes a drafter this trainer exported"):
        settings.check_init_from(c, dcfg)


def test_configuration_page_is_the_table_the_constants_make():
    """docs/configuration.md's table is generated from the constants' comments (trainer.settings.config_table): a
    constant or comment changed without rerunning `python -m tools.config_page` fails here, naming that command."""
    from tools import config_page
    page = config_page.PAGE.read_text()
    assert page.count(config_page.BEGIN) == 1 and page.count(config_page.END) == 1
    assert all(f"| `{k}` |" in page for k in td.CONFIG_KEYS)
    stale = config_page.differences()
    assert not stale, stale


FAKE_PROGRAM = """\"\"\"A program with one new knob.\"\"\"
import os

# --- what to train ------------
OLD = "a"       # an old knob

# --- tuning -------------------
WIDGETS = 3     # [>= 1] widgets per batch | fewer on CPU (<= MAX_WIDGETS, docs/widgets.md)
#                 counted per rank, python -m tools.widgets --rank 0 prints them
CONFIG_KEYS = []
"""


def test_a_new_constant_reaches_help_the_page_and_the_checks_from_its_one_line(tmp_path):
    """A knob is its constant and its comment: --help, the page's row (continuation joined, | escaped, paths and
    commands as code) and the range check all come from there."""
    src = tmp_path / "prog.py"
    src.write_text(FAKE_PROGRAM)
    assert settings.ranges_of(src) == {"WIDGETS": (1, False)}
    help_lines = settings.help_text(src).splitlines()
    knob = help_lines.index(next(l for l in help_lines if l.startswith("  --WIDGETS=3 ")))
    assert help_lines[knob - 1:knob + 2] == ["tuning:", "  --WIDGETS=3".ljust(34) + " [>= 1] widgets per batch | "
                                             "fewer on CPU (<= MAX_WIDGETS, docs/widgets.md)", " " * 35 + "counted per "
                                             "rank, python -m tools.widgets --rank 0 prints them"]
    assert settings.config_table(src).splitlines() == [
        "| constant | default | meaning |", "|---|---|---|", "| **what to train** | | |",
        '| `OLD` | `"a"` | an old knob |', "| **tuning** | | |",
        "| `WIDGETS` | `3` | [>= 1] widgets per batch \\| fewer on CPU (&lt;= MAX_WIDGETS, `docs/widgets.md`) "
        "counted per rank, `python -m tools.widgets --rank 0` prints them |"]


def test_config_page_rewrites_only_its_table_and_check_names_the_fix(tmp_path, capsys):
    from tools import config_page
    src, page = tmp_path / "prog.py", tmp_path / "page.md"
    src.write_text(FAKE_PROGRAM)
    prose = ("# Page\n\nBy hand.\n\n", "\n## More\n\nAlso by hand: | `WIDGETS` | `4` |\n")
    page.write_text(f"{prose[0]}{config_page.BEGIN}\n| old table |\n{config_page.END}{prose[1]}")
    with pytest.raises(SystemExit) as stale:
        config_page.main(["--check", "--page", str(page), "--source", str(src)])
    assert "-| old table |" in stale.value.code and "+| `WIDGETS` | `3` |" in stale.value.code
    assert stale.value.code.endswith("regenerate it: python -m tools.config_page")
    config_page.main(["--page", str(page), "--source", str(src)])
    table = settings.config_table(src)
    assert page.read_text() == f"{prose[0]}{config_page.BEGIN}\n{table}{config_page.END}{prose[1]}"
    config_page.main(["--check", "--page", str(page), "--source", str(src)])
    assert "the table is the constants'" in capsys.readouterr().out
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="has no .* pair to write the table between"):
        config_page.main(["--page", str(page), "--source", str(src)])


def test_every_closed_choice_list_is_the_codes_and_refused_otherwise(cfg):
    """The allowed values written in the constants' comments are what the code accepts (its own registries, where
    it has one), and check_config refuses anything else, for every such constant."""
    from model import fp8
    from model.drafter import COMPILE_MODES
    from model.drafters import ARCHS
    from model.objective import WEIGHTINGS
    assert settings.CHOICES == {
        "DRAFTER_ARCH": tuple(ARCHS), "LOSS_WEIGHTING": tuple(WEIGHTINGS), "DEVICE": ("auto", "cuda", "cpu"),
        "DTYPE": ("auto", "bfloat16", "float32"), "ATTN": ("auto", "flex", "sdpa"),
        "COMPILE_DRAFTER": tuple(COMPILE_MODES), "DRAFTER_FP8_RECIPE": tuple(fp8.RECIPES),
        "DRAFTER_SHARDING": ("ddp", "fsdp"), "EVAL_DTYPE": ("float32", "bfloat16")}
    for name, allowed in settings.CHOICES.items():
        assert getattr(td, name) in allowed
        cfg.set(**{name: "nonsense"})
        assert f"{name}='nonsense': allowed are {', '.join(allowed)}" in cfg.check(), name
        cfg.set(**{name: getattr(td, name)})
    assert settings.UPPER_BOUNDS == {"WARMUP_RATIO": (1, True), "DPACE_ALPHA": (1, False)}


def test_choices_and_bounds_are_read_from_the_comment_alone(tmp_path):
    """A list closes where prose starts (`:`, `.`, the end) and may carry a parenthetical per value; one that ends
    in a non-word (a path, `<...>`) is open and checks nothing, as is prose that merely starts with a word."""
    src = tmp_path / "prog.py"
    src.write_text("# --- s ---\nMODE = \"a\"   # a (the first (nested) one) | b_2 | c: which\n"
                   "#                more about it | d\nWHERE = \"auto\"   # auto | scratch | <a path>\n"
                   "NOTE = \"\"   # plain prose (with a note) here\nFRAC = 0.1   # [>= 0] [< 1] share | of it\n"
                   "K = 1   # [>= 1] [<= 8] x | y (a closed list after the range)\nCONFIG_KEYS = []\n")
    assert settings.choices_of(src) == {"MODE": ("a", "b_2", "c"), "K": ("x", "y")}
    assert settings.upper_bounds_of(src) == {"FRAC": (1, True), "K": (8, False)}
    assert settings.ranges_of(src) == {"FRAC": (0, False), "K": (1, False)}


def test_a_range_is_read_from_the_constants_comment(tmp_path):
    src = tmp_path / "prog.py"
    src.write_text("# --- s ---\nA = 1   # [>= 1] things\nB = 0.5   # [> 0] seconds\nC = 2   # no range\n"
                   "CONFIG_KEYS = []\n")
    assert settings.ranges_of(src) == {"A": (1, False), "B": (0, True)}
    assert "  --B=0.5" in settings.help_text(src) and "[> 0] seconds" in settings.help_text(src)


def test_a_hub_id_target_resolves_from_the_local_cache(tmp_path, monkeypatch):
    """TARGET=org/name: its snapshot folder in the local Hugging Face cache, never the network; absent, an error
    naming the cache folder looked in."""
    from test_target import fake_hub_cache
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    c = {"TARGET": "Qwen/Qwen3-8B", "DATA": "prepared"}
    with pytest.raises(SystemExit, match=rf"error: TARGET: model Qwen/Qwen3-8B: not in the Hugging Face cache "
                                         rf"{tmp_path / 'hub'}"):
        settings.resolve_paths(c)
    snap = fake_hub_cache(tmp_path / "hub")
    settings.resolve_paths(c)
    assert c == {"TARGET": str(snap), "DATA": "prepared"}


def test_eval_dflash_takes_a_hub_id_target(tmp_path, monkeypatch, tiny_qwen3_dir):
    import shutil
    from types import SimpleNamespace

    import eval_dflash
    from test_target import fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = fake_hub_cache(tmp_path / "hub", files=())
    for f in tiny_qwen3_dir.iterdir():
        shutil.copy(f, snap / f.name)
    a = SimpleNamespace(target="Qwen/Qwen3-8B", max_new_tokens=8, limit=None, block_size=None, tree_budget=0,
                        tree_top_k=4, workers=1, method="decode", attention="sdpa", drafter=[])
    errs = eval_dflash.check_args(a)
    assert a.target == str(snap) and not any("--target" in e for e in errs), errs


def test_in_training_evaluation_leaves_out_what_the_template_refuses(monkeypatch, no_system_target, tiny_smollm2,
                                                                      capsys):
    """The default EVAL_PROMPTS (the broad set) with a target whose template has no system role: the system
    category is left out, said once at start-up, and EVAL_LIMIT is dealt over the other nine categories; a
    template that takes them keeps all ten."""
    from transformers import AutoTokenizer
    monkeypatch.setattr(td, "EVAL_PROMPTS", "")
    monkeypatch.setattr(td, "EVAL_LIMIT", 20)
    got = phases.eval_inputs(td.constants(), AutoTokenizer.from_pretrained(no_system_target), {})
    cats = [r["category"] for r in got["prompts"]]
    assert len(cats) == 20 and "system" not in cats and len(set(cats)) == 9
    assert "note: EVAL_PROMPTS: the target's chat template refuses 30 of 313 prompts" in capsys.readouterr().out
    full = phases.eval_inputs(td.constants(), AutoTokenizer.from_pretrained(tiny_smollm2), {})
    assert len({r["category"] for r in full["prompts"]}) == 10 and "note:" not in capsys.readouterr().out
