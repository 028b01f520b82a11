from kvrelay.cli import main


def test_bench_core_prints_the_ratio_line(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "core", "--sizes", "10", "40", "--steps", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("per-request step cost ratio 40/10: ")
    assert float(last.rsplit(" ", 1)[1]) > 0
