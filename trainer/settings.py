"""train_dflash.py's settings: `--NAME=VALUE` overrides of its constants, `--help` and docs/configuration.md's table
(`config_table`, which tools/config_page.py writes), both read from the constants block of its source, the checks a
user can act on before any model loads (`check_config`, `check_init_from`), and the choices made from the target's
tokenizer (`choose_mask_token_id`). Functions take the settings as `c`, a `Settings`: the constants as read-only
attributes (train_dflash.constants())."""
import ast
import difflib
import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from safetensors.torch import load_file

from trainer import checkpoint as ckpt
from model.drafter import DrafterConfig
from model.drafters import ARCHS, arch_of, export_arch
from model.hub import HUB_ID, resolve_model_path
from model.target import DEFAULT_TARGET, check_mask_token_id, default_mask_token_id

REPO = Path(__file__).resolve().parents[1]
DEFAULT_EVAL_PROMPTS = REPO / "data" / "default" / "eval_broad.jsonl"   # EVAL_PROMPTS="": ten categories of traffic

RANGE_TAG = re.compile(r"^\[(>=|>) (-?[0-9.e+-]+)\] ")   # a constant's comment opening with its allowed range
UPPER_TAG = re.compile(r"\[(<=|<) (-?[0-9.e+-]+)\] ")    # ... and its upper bound, right after it
CHOICE_WORD = re.compile(r"[a-z][a-z0-9_]*")                # one value of an allowed-values list, a | b | c



class Settings(SimpleNamespace):
    """The run's settings, frozen: train_dflash.py's constants after the overrides, read as c.NAME. The library reads
    them from here and never from train_dflash's globals; a value is changed on the command line, not in flight."""

    def __setattr__(self, name, value):
        raise AttributeError(f"the settings are frozen: set {name} as a constant or --{name}=VALUE")

    def __delattr__(self, name):
        raise AttributeError(f"the settings are frozen: {name} stays")

    def replace(self, **changes) -> "Settings":
        """A copy with `changes` (names it already has): the run's values filled in from the target, a bench's shape."""
        unknown = set(changes) - set(vars(self))
        assert not unknown, f"not settings: {sorted(unknown)}"
        return Settings(**{**vars(self), **changes})

    def as_dict(self) -> dict:
        """{NAME: value}: the JSON snapshot in run.json, every checkpoint's meta and the W&B run's config."""
        return dict(vars(self))


# --- overrides and --help -------------------------------------------------------------------------------------------

def parse_overrides(argv: list[str], defaults: dict, source: Path) -> tuple[dict, set[str]]:
    """--NAME=VALUE for the constants of `source` (defaults: {NAME: value}); unknown names and wrong types are
    errors, --help prints the constants. -> (the settings, the names given on the command line)."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(source))
        sys.exit(0)
    c, given = dict(defaults), set()
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            sys.exit(f"error: arguments are --NAME=VALUE (or --help), got {arg!r}")
        name, value = arg[2:].split("=", 1)
        if name not in defaults:
            close = difflib.get_close_matches(name, list(defaults), n=3)
            sys.exit(f"error: unknown setting --{name}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                     + f"; settings are the constants at the top of {source.name} (--help lists them)")
        default = defaults[name]
        try:
            if isinstance(default, bool):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError
                c[name] = value.lower() in ("1", "true", "yes")
            else:
                c[name] = type(default)(value)
        except ValueError:
            sys.exit(f"error: --{name}={value!r} is not a valid {type(default).__name__} (default: {default!r})")
        given.add(name)
    return c, given


def constant_lines(source: Path):
    """The constants block of `source` (from its first `# --- section` to CONFIG_KEYS), line by line: ("section",
    title, ""), ("constant", NAME, default text, comment) or ("more", comment), a comment continuing the one
    above."""
    text = Path(source).read_text()
    lines = text.splitlines()
    values = {n.lineno: (n.targets[0].id, lines[n.lineno - 1][n.value.col_offset:n.value.end_col_offset])
              for n in ast.parse(text).body if isinstance(n, ast.Assign) and len(n.targets) == 1
              and isinstance(n.targets[0], ast.Name) and n.targets[0].id.isupper()}
    first = next(i for i, l in enumerate(lines) if l.startswith("# --- "))
    for i, line in enumerate(lines[first:], first + 1):
        if line.startswith("CONFIG_KEYS"):
            break
        if line.startswith("# --- "):
            yield "section", line.strip("# -"), ""
        elif i in values:
            name, value = values[i]
            comment = line.split("#", 1)[1].strip() if "#" in line[len(name) + 3 + len(value):] else ""
            yield "constant", name, value, comment
        elif line.strip().startswith("#"):
            yield "more", line.strip().lstrip("#").strip()


def _bound(text: str) -> float | int:
    """A range tag's number as written: 1 an int, 0.5 or 1e-3 a float."""
    return float(text) if "." in text or "e" in text else int(text)


def ranges_of(source: Path) -> dict[str, tuple[float, bool]]:
    """{NAME: (bound, strict)} for every constant of `source` whose comment opens with its range: [>= N] (value >= N)
    or [> N] (value > N, strict). check_config enforces them, with finiteness for floats."""
    out = {}
    for kind, *rest in constant_lines(source):
        if kind == "constant" and (m := RANGE_TAG.match(rest[2])):
            out[rest[0]] = (_bound(m.group(2)), m.group(1) == ">")
    return out


RANGES = ranges_of(REPO / "train_dflash.py")   # {NAME: (bound, strict)}, read from the constants' comments


def comments_of(source: Path) -> dict[str, str]:
    """{NAME: its whole comment} of every constant of `source`, continuation lines joined with spaces."""
    out, last = {}, None
    for kind, *rest in constant_lines(source):
        if kind == "constant":
            last = rest[0]
            out[last] = rest[2]
        elif kind == "more" and last:
            out[last] = f"{out[last]} {rest[0]}".strip()
        else:
            last = None
    return out


def upper_bounds_of(source: Path) -> dict[str, tuple[float, bool]]:
    """{NAME: (bound, strict)} for every constant whose comment's range has a second tag, an upper bound: [< N]
    (value < N, strict) or [<= N], after its lower one (`[>= 0] [< 1]`). check_config enforces them."""
    out = {}
    for name, comment in comments_of(source).items():
        if (lo := RANGE_TAG.match(comment)) and (m := UPPER_TAG.match(comment, lo.end())):
            out[name] = (_bound(m.group(2)), m.group(1) == "<")
    return out


def _closed_list(text: str) -> tuple[str, ...] | None:
    """`a | b (what b means) | c: more prose` -> ("a", "b", "c"): bare lower-case words, each optionally followed
    by one parenthetical, joined by ` | `, ending the comment or followed by `:`, `;`, `,` or `.`. Else None: fewer
    than two, prose (`share | of it`), or a value that is not a word (RESUME's `auto | scratch | <checkpoint path>`,
    an open list)."""
    options, i = [], 0
    while (m := CHOICE_WORD.match(text, i)):
        options.append(m.group())
        i = m.end()
        if text.startswith(" (", i):   # skip its balanced parenthetical
            depth, j = 0, i + 1
            for j in range(i + 1, len(text)):
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                if depth == 0:
                    break
            if depth:
                return None
            i = j + 1
        if not text.startswith(" | ", i):   # the list ends: at the comment's end or a punctuation mark, else prose
            return tuple(options) if len(options) > 1 and text[i:i + 1] in ("", ":", ";", ",", ".") else None
        i += 3
    return None


def choices_of(source: Path) -> dict[str, tuple[str, ...]]:
    """{NAME: its allowed values} for every constant whose comment opens with a closed list of them, `a | b | c`
    (after its range, if any): check_config refuses any other value, and --help and docs/configuration.md show the
    list as written."""
    out = {}
    for name, comment in comments_of(source).items():
        start = m.end() if (m := RANGE_TAG.match(comment)) else 0
        start = u.end() if (u := UPPER_TAG.match(comment, start)) else start
        if (options := _closed_list(comment[start:])):
            out[name] = options
    return out


UPPER_BOUNDS = upper_bounds_of(REPO / "train_dflash.py")   # {NAME: (bound, strict)}
CHOICES = choices_of(REPO / "train_dflash.py")             # {NAME: allowed values}


def help_text(source: Path) -> str:
    """The constants block of `source` as --help: each section, each constant as --NAME=default with its comment
    (its range, units, allowed values), continuation comments below it."""
    name = Path(source).name
    out = [f"usage: python {name} [--NAME=VALUE ...]   (or torchrun ... {name} ...)",
           "Every constant below can be set as --NAME=VALUE; the default is shown."]
    for kind, *rest in constant_lines(source):
        if kind == "section":
            out += ["", rest[0] + ":"]
        elif kind == "constant":
            out.append(f"  --{rest[0]}={rest[1]}".ljust(34) + " " + rest[2])
        elif out:
            out.append(" " * 35 + rest[0])
    return "\n".join(out)


# in a comment, what the page shows as code: a `python -m` command with its flags; a path: a folder/, a path with a
# slash and a lower-case letter (not SIGTERM/SIGINT) or a file name with an extension. The rest is prose
CODE_IN_COMMENT = re.compile(r"python -m [\w.]+(?: --[\w-]+(?:[ =][\w./]+)?)*"
                             r"|(?<![\w./-])(?:(?=[\w./-]*[a-z])[A-Za-z_][\w.-]*/(?:[\w./-]*[\w/])?"
                             r"|[\w-]+\.(?:md|py|jsonl?|txt|log|sh|safetensors))(?![\w/-])")


def _pipes(text: str) -> str:
    """`|` escaped: GitHub's tables split a row on it, even inside code."""
    return text.replace("|", "\\|")


def _markdown_cell(text: str) -> str:
    """A comment as one table cell: commands and paths in backticks, `|` escaped everywhere, `\\`, `<` and `*` in the
    prose too (no stray emphasis or HTML tag)."""
    def prose(s):
        return _pipes(s.replace("\\", "\\\\")).replace("<", "&lt;").replace("*", "\\*")
    out, at = [], 0
    for m in CODE_IN_COMMENT.finditer(text):
        out += [prose(text[at:m.start()]), "`" + _pipes(m.group()) + "`"]
        at = m.end()
    return "".join(out + [prose(text[at:])])


def config_table(source: Path) -> str:
    """The constants block of `source` as docs/configuration.md's table: a bold row per section, then a row per
    constant: `NAME`, its default, its comment with the continuation lines below it (the range first, as --help
    shows it). tools/config_page.py writes it into the page."""
    rows, last = ["| constant | default | meaning |", "|---|---|---|"], None
    for kind, *rest in constant_lines(source):
        if kind == "section":
            rows.append(f"| **{rest[0]}** | | |")
            last = None
        elif kind == "constant":
            last = [rest[0], rest[1], [rest[2]] if rest[2] else []]
            rows.append(last)
        elif last:   # a comment continuing the constant's: the same cell
            last[2].append(rest[0])
    return "\n".join(r if isinstance(r, str) else f"| `{r[0]}` | `{_pipes(r[1])}` | {_markdown_cell(' '.join(r[2]))} |"
                     for r in rows) + "\n"


def resolve_paths(c: dict) -> None:
    """Fill the embedded defaults into c: SmolLM2 from the cache (model.target.DEFAULT_TARGET), the shipped
    dataset; a TARGET that is a Hub id becomes its folder in the local Hugging Face cache (never the network)."""
    if not c["TARGET"]:
        c["TARGET"] = str(DEFAULT_TARGET)
        if not (DEFAULT_TARGET / "config.json").exists():
            sys.exit(f"error: no TARGET given and the default SmolLM2 folder {DEFAULT_TARGET} does not exist: run "
                     f"`python -m tools.smollm2` (launch.sh does) or pass --TARGET=/path/to/hf/model")
    elif not Path(c["TARGET"]).expanduser().exists() and HUB_ID.fullmatch(c["TARGET"]):
        # org/name and no such folder: a Hub id, its snapshot folder in the local cache (check_config names a
        # missing folder of any other form)
        try:
            c["TARGET"] = str(resolve_model_path(c["TARGET"]))
        except FileNotFoundError as e:
            sys.exit(f"error: TARGET: {e}")
    if not c["DATA"]:
        c["DATA"] = str(REPO / "data" / "default" / "smollm2")


# --- checks ---------------------------------------------------------------------------------------------------------

def _topology_errors(c, world: int) -> list[str]:
    """TARGET_RANKS and TARGET_SHARDS against the job's world size, and what a sharded target cannot run."""
    errs = []
    if world > 1 and not 1 <= c.TARGET_RANKS < world:
        errs.append(f"TARGET_RANKS={c.TARGET_RANKS} must be between 1 and world size - 1 = {world - 1} "
                    f"(at least one drafter rank); launch more processes or lower TARGET_RANKS")
    if c.TARGET_SHARDS > 1:
        if world == 1:
            errs.append(f"TARGET_SHARDS={c.TARGET_SHARDS} needs a torchrun job: one process runs the whole target; "
                        f"launch TARGET_RANKS + drafter processes or set TARGET_SHARDS=1")
        elif c.TARGET_RANKS % c.TARGET_SHARDS:
            errs.append(f"TARGET_RANKS={c.TARGET_RANKS} is not a multiple of TARGET_SHARDS={c.TARGET_SHARDS} (each "
                        f"target replica spans TARGET_SHARDS ranks): set TARGET_RANKS to a multiple of it")
        for name, why in (("COMPILE_TARGET", "torch.compile would trace FSDP's all-gather hooks inside each layer"),
                          ("TARGET_FP8", "torchao's FP8 weights cannot be sharded and all-gathered by FSDP")):
            if getattr(c, name):
                errs.append(f"{name} does not work with TARGET_SHARDS={c.TARGET_SHARDS} ({why}): set --{name}=False "
                            f"or TARGET_SHARDS=1")
    return errs


def _target_errors(c) -> list[str]:
    """What TARGET's config.json rules out: not a causal LM, no weights, HEAD_FP8 sizes that do not fit."""
    errs = []
    tgt = Path(c.TARGET).expanduser()
    if not (tgt / "config.json").exists():
        errs.append(f"TARGET={c.TARGET} has no config.json: it must be a local Hugging Face model folder")
    else:
        tcfg = json.loads((tgt / "config.json").read_text())
        arch = tcfg.get("architectures") or []
        if not any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in arch):
            errs.append(f"TARGET={c.TARGET} is not a causal LM (architectures={arch}); DFlash needs a decoder-only "
                        f"*ForCausalLM target")
        elif not any(next(tgt.glob(pat), None) for pat in ckpt.WEIGHT_FILES):
            errs.append(f"TARGET={c.TARGET} has a config.json but no weights ({', '.join(ckpt.WEIGHT_FILES)}): "
                        f"download the model's weight files into it")
        tc = tcfg.get("text_config", tcfg)
        V, H = tc.get("vocab_size", 0), tc.get("hidden_size", 0)
        if c.HEAD_FP8:
            if V % 16 or H % 16:
                errs.append(f"HEAD_FP8 needs the target's lm_head [vocab_size, hidden_size] = [{V}, {H}] in multiples "
                            f"of 16 (FP8 GEMMs): set --HEAD_FP8=False")
    return errs


def _target_sizes(c) -> tuple:
    """(vocab_size, hidden_size) of TARGET's config.json (0 where it has none); (None, None) without the file."""
    tgt = Path(c.TARGET).expanduser() / "config.json"
    if not tgt.exists():
        return None, None
    tcfg = json.loads(tgt.read_text())
    tc = tcfg.get("text_config", tcfg)
    return tc.get("vocab_size", 0), tc.get("hidden_size", 0)


def check_config(c, world: int) -> None:
    """Contradictions a user can fix in the settings c (train_dflash's constants as attributes), reported before
    any model is loaded."""
    errs = _topology_errors(c, world)
    for name, (lo, strict) in RANGES.items():
        v = getattr(c, name)
        if not math.isfinite(v) or (v <= lo if strict else v < lo):
            errs.append(f"{name}={v} must be {'>' if strict else '>='} {lo:g}"
                        + (" and finite" if isinstance(v, float) else ""))
    for name, (hi, strict) in UPPER_BOUNDS.items():
        v = getattr(c, name)
        if math.isfinite(v) and (v >= hi if strict else v > hi):
            errs.append(f"{name}={v} must be {'<' if strict else '<='} {hi:g}")
    for name, allowed in CHOICES.items():
        if getattr(c, name) not in allowed:
            errs.append(f"{name}={getattr(c, name)!r}: allowed are {', '.join(allowed)}")
    if c.SLIDING_WINDOW_LAYERS > c.NUM_DRAFT_LAYERS:
        errs.append(f"SLIDING_WINDOW_LAYERS={c.SLIDING_WINDOW_LAYERS} must be <= NUM_DRAFT_LAYERS={c.NUM_DRAFT_LAYERS}")
    if c.RESUME not in ("auto", "scratch") and not Path(c.RESUME).exists():
        errs.append(f"RESUME={c.RESUME!r} is neither auto, scratch nor an existing checkpoint folder")
    if c.INIT_FROM and not all((Path(c.INIT_FROM) / f).is_file() for f in ("config.json", "model.safetensors")):
        errs.append(f"INIT_FROM={c.INIT_FROM} is not an exported drafter folder (config.json + model.safetensors, "
                    f"e.g. runs/x/checkpoints/step_N/drafter)")
    if Path(c.OUT_DIR).exists() and not Path(c.OUT_DIR).is_dir():
        errs.append(f"OUT_DIR={c.OUT_DIR} is a file, not a folder: point OUT_DIR at a folder (it is created if "
                    f"missing)")
    errs += _target_errors(c)
    if c.HEAD_FP8 and not c.CE_CHUNK:   # the unchunked loss is the bf16 reference: HEAD_FP8 would do nothing there
        errs.append("HEAD_FP8 runs in the chunked loss only, and CE_CHUNK=0 is the unchunked reference: set "
                    "--CE_CHUNK=4096 or --HEAD_FP8=False")
    if c.FLEX_OPTIONS:
        try:
            if not isinstance(json.loads(c.FLEX_OPTIONS), dict):
                raise ValueError
        except ValueError:
            errs.append(f"FLEX_OPTIONS={c.FLEX_OPTIONS!r} is not a JSON object of flex_attention kernel_options "
                        f"(e.g. '{{\"USE_TMA\": true}}'; \"\" for torch's defaults)")
    if c.DRAFTER_ARCH in ARCHS:   # its knobs against the settings and the target's sizes (an unknown arch: CHOICES)
        errs += ARCHS[c.DRAFTER_ARCH].check(c, *_target_sizes(c))
    if c.DRAFTER_SHARDING == "fsdp" and world == 1:
        errs.append("DRAFTER_SHARDING=fsdp shards the drafter over the drafter ranks of a torchrun job; the one "
                    "process holds it whole: launch with torchrun (launch.sh), or use DRAFTER_SHARDING=ddp")
    elif c.DRAFTER_SHARDING == "fsdp" and c.DRAFTER_FP8:
        errs.append("DRAFTER_FP8 with DRAFTER_SHARDING=fsdp is not supported yet (float8 weights would need FSDP2's "
                    "float8 all-gather): use one of them")
    if c.EVAL_EVERY and not Path(c.EVAL_PROMPTS or DEFAULT_EVAL_PROMPTS).exists():
        errs.append(f"EVAL_PROMPTS={c.EVAL_PROMPTS!r} does not exist (a JSONL of prompts, see eval_dflash.py)")
    if not Path(c.DATA).is_dir():
        errs.append(f"DATA={c.DATA} is not a folder: prepare one with `python -m data.prepare --tokenizer "
                    f"{c.TARGET} --out DIR INPUT.jsonl`")
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


def check_init_from(c, dcfg) -> list[str]:
    """INIT_FROM's config.json against the drafter this run builds (dcfg), before any model loads. Exits naming
    every setting that differs, both values and the flag that fits the export; returns notes on fields that are
    not shapes (RoPE, norm eps, context length), which the run takes from its target."""
    cfg = json.loads((Path(c.INIT_FROM) / "config.json").read_text())
    if not isinstance(cfg, dict) or "dflash_config" not in cfg or "num_target_layers" not in cfg:
        sys.exit(f"error: INIT_FROM={c.INIT_FROM} is not an exported drafter (its config.json has no dflash_config / "
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
    knobs, arch = cfg["dflash_config"], ARCHS[c.DRAFTER_ARCH]
    if cfg.get("architectures") == [arch.serving_name]:   # an export of this arch: its knobs (Arch.knobs) too
        errs += [f"{name}: this run has {getattr(c, name)}, the drafter in INIT_FROM {knobs[key]}: pass "
                 f"--{name}={knobs[key]}" for name, key in arch.knobs.items()
                 if knobs.get(key) is not None and knobs[key] != getattr(c, name)]
    if of_target:
        errs.append(f"the target (TARGET={c.TARGET}) has " + ", ".join(f"{f}={o}" for f, o, _ in of_target)
                    + "; the drafter in INIT_FROM was made for " + ", ".join(f"{f}={t}" for f, _, t in of_target)
                    + ": it was trained for another target")
    if errs:
        sys.exit(f"error: INIT_FROM={c.INIT_FROM} does not fit this run's drafter:\n  - " + "\n  - ".join(errs))
    return [f"NOTE: INIT_FROM has {f}={getattr(src, f)}, this run uses its target's {getattr(dcfg, f)}"
            for f in ("rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings")
            if getattr(src, f) != getattr(dcfg, f)]


def load_init_from(path, drafter) -> str:
    """The INIT_FROM export's weights into the run's drafter, whose fp32 master weights take them in whatever dtype
    the export was written (fp32 exactly; bf16 widened exactly). path: INIT_FROM. Returns that dtype, and the arch
    of the export when the run's arch warm-starts from another's (Arch.warm_start: "bfloat16 DFlash")."""
    state = load_file(str(Path(path) / "model.safetensors"), device=str(next(drafter.parameters()).device))
    dtypes = "/".join(sorted({str(v.dtype).replace("torch.", "") for v in state.values()}))
    arch, theirs = arch_of(drafter), export_arch(path)
    if theirs == arch.warm_from and arch.warm_start(drafter, state):
        return f"{dtypes} {ARCHS[theirs].title}"   # its backbone; the arch's own parameters at init: drafts as it did
    if ARCHS[theirs] is not arch:
        sys.exit(f"error: INIT_FROM={path} is a {ARCHS[theirs].title} drafter and this run trains a {arch.title} "
                 f"one: set --DRAFTER_ARCH={theirs} (its knobs as in its config.json's dflash_config)")
    missing = drafter.state_dict().keys() - state.keys()
    extra = state.keys() - drafter.state_dict().keys()
    if missing or extra:
        sys.exit(f"error: INIT_FROM={path}: model.safetensors does not hold this drafter's parameters (missing "
                 f"{sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}); export it with model.export.export_drafter")
    drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return dtypes


# --- from the target's tokenizer ---------------------------------------------------------------------------------

def choose_mask_token_id(c, tok, vocab_rows) -> int:
    """MASK_TOKEN_ID, or the first unused id when it is -1, checked against the target's tokenizer."""
    mask_id = c.MASK_TOKEN_ID
    if mask_id < 0:
        if tok is None:
            sys.exit(f"error: TARGET={c.TARGET} has no tokenizer, so MASK_TOKEN_ID cannot be chosen: pass "
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
