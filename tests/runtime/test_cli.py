"""`pagedjax --help` lists every command whatever is installed; a command whose optional
dependency is missing says which package to install, in one line, exit 2."""

from __future__ import annotations

import sys

import pytest

from runtime.cli import build_parser, main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("pull", "convert", "inspect", "generate", "serve", "fleet", "bench", "plan"):
        assert command in out


@pytest.mark.parametrize("module", ["ray", "zmq", "matplotlib"])
def test_commands_stay_registered_without_optional_dependencies(monkeypatch, capsys, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "fleet" in capsys.readouterr().out


def test_fleet_without_ray_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["fleet", "serve", "--checkpoint", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pagedjax: error: 'pagedjax fleet' needs ray[serve]: bash scripts/setup.sh fleet (in the pagedjax checkout)"]


def test_kv_events_without_pyzmq_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "zmq", None)
    assert main(["fleet", "serve", "--checkpoint", str(tmp_path / "missing"),
                 "--kv-events-endpoint", "tcp://*:5557"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pagedjax: error: 'pagedjax fleet serve --kv-events-endpoint' needs pyzmq: "
                   "bash scripts/setup.sh fleet (in the pagedjax checkout)"]


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pagedjax: error: 'pagedjax bench serve --plot' needs matplotlib: bash scripts/setup.sh bench (in the pagedjax checkout)"]


def _parser_running(func):
    """The real parser, whose parsed command runs `func` instead (through parse_args, the
    public interface main() uses, not argparse's private action list)."""
    parser = build_parser()
    parse = parser.parse_args

    def parse_args(argv=None, namespace=None):
        args = parse(argv, namespace)
        args.func = func
        return args

    parser.parse_args = parse_args
    return parser


def test_an_optional_import_failing_inside_a_command_is_one_line(monkeypatch, capsys):
    """A command that imports an optional module without declaring it still gets the one line."""
    import argparse

    def needs_torch(args: argparse.Namespace) -> int:
        import torch  # noqa: F401
        return 0

    monkeypatch.setattr("runtime.cli.build_parser", lambda: _parser_running(needs_torch))
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["pull"]) == 2
    assert capsys.readouterr().err.strip() == "pagedjax: error: 'pagedjax pull' needs torch: bash scripts/setup.sh peer (in the pagedjax checkout)"


def test_a_broken_required_import_is_not_disguised(monkeypatch):
    import argparse

    def broken(args: argparse.Namespace) -> int:
        import pagedjax_no_such_module  # noqa: F401
        return 0

    monkeypatch.setattr("runtime.cli.build_parser", lambda: _parser_running(broken))
    with pytest.raises(ModuleNotFoundError):
        main(["pull"])


def test_admission_flags_default_to_the_policy_defaults():
    from runtime.config import AdmissionPolicy

    args = build_parser().parse_args(["serve"])
    policy = AdmissionPolicy()
    for name in ("max_queued_tokens", "max_queue_len", "max_admissions_per_step"):
        assert getattr(args, name) == getattr(policy, name), name
