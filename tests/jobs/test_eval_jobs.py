"""eval_dflash.py --workers: N worker processes of the script (each loading the target) give one process's results,
and a worker that fails fails the run naming it. Two exported random drafters on the tiny Qwen3 target."""
import json
import re

import pytest

from eval_cases import B, prompts, untimed
from eval_dflash import main
from model.export import export_drafter


@pytest.fixture
def cli_folder(build_drafter, tiny_qwen3_dir, tmp_path):
    """Two exported random drafters and 5 pre-tokenized prompts (the tiny target folder has no tokenizer)."""
    for seed in (0, 1):
        export_drafter(build_drafter(tiny_qwen3_dir, num_layers=2, block_size=B, seed=seed), tmp_path / f"d{seed}")
    rows = prompts(lengths=(5, 13, 30, 8, 21))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def cli(target_dir, folder, *extra, drafters=("d0", "d1"), prompts_file="p.jsonl"):
    return ["--target", str(target_dir), "--drafter", *[str(folder / d) for d in drafters],
            "--prompts", str(folder / prompts_file), "--device", "cpu", "--max-new-tokens", "12", *extra]


def test_cli_workers_equal_one_process(cli_folder, tiny_qwen3_dir, capsys):
    args = cli(tiny_qwen3_dir, cli_folder, "--tree-budget", "6")
    one = main(args + ["--workers", "1", "--out", str(cli_folder / "w1.json")])
    text1 = capsys.readouterr().out
    two = main(args + ["--workers", "2", "--out", str(cli_folder / "w2.json")])
    text2 = capsys.readouterr().out
    assert json.loads((cli_folder / "w2.json").read_text())["drafters"][1]["drafter"] == str(cli_folder / "d1")
    assert [r["drafter"] for r in one["drafters"]] == [str(cli_folder / d) for d in ("d0", "d1")]
    for a, b in zip(one["drafters"], two["drafters"]):
        assert a["config"]["workers"] == 1 and b["config"]["workers"] == 2
        assert [r["id"] for r in b["per_prompt"]] == ["p0", "p1", "p2", "p3", "p4"]
        assert [untimed(r) for r in b["per_prompt"]] == [untimed(r) for r in a["per_prompt"]]
        for key in ("tau", "tree_tau", "lossless", "prompts", "tau_by_category", "accept_hist", "tree_accept_hist"):
            assert b[key] == a[key], key
        assert a["lossless"] and a["prompts"] == 5 and sum(a["accept_hist"].values()) > 5
    assert one["drafters"][0]["per_prompt"] != one["drafters"][1]["per_prompt"]      # two different drafters
    for text, res in ((text1, one), (text2, two)):
        lines = text.strip().splitlines()
        assert re.fullmatch(r"tau=\d+\.\d\d lossless=yes prompts=5", lines[-1]), lines[-1]
        assert lines[-1] == f"tau={res['drafters'][1]['tau']:.2f} lossless=yes prompts=5"
        assert sum(line.startswith("tau=") for line in lines) == 2
    assert "2 workers sharing the device" in text2 and "workers sharing" not in text1


def test_cli_failing_worker_fails_the_run(cli_folder, tiny_qwen3_dir):
    rows = [json.loads(line) for line in (cli_folder / "p.jsonl").read_text().splitlines()][:3]
    rows[1]["input_ids"][2] = 10_000                                  # outside the vocabulary: only worker 1 has it
    (cli_folder / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_qwen3_dir, cli_folder, "--workers", "2", prompts_file="bad.jsonl"))
    assert "worker 1/2 failed" in str(e.value) and "index out of range" in str(e.value), e.value
    with pytest.raises(SystemExit) as e:
        main(cli(tiny_qwen3_dir, cli_folder, "--workers", "2", drafters=("d0", "nope")))
    assert "has no config.json" in str(e.value) and str(cli_folder / "nope") in str(e.value), e.value  # up front
