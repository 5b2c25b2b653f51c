"""tools/loss_range.py: one jaxpar-train run per instruction set (here a stand-in for subprocess.run, so nothing
trains), its final-loss line parsed and the range printed; a run without that line fails the tool."""

import importlib.util
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("loss_range", os.path.join(ROOT, "tools", "loss_range.py"))
loss_range = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loss_range)

# jaxpar.training.hooks.evaluation.EvalHook.on_end's line, as jaxpar-train logs it
LINE = (
    "final val_loss {loss} nats/token over 8,191 validation tokens (64 of 3,178 validation sequences) vs their "
    "unigram entropy 3.0085 (ratio {ratio})"
)


def test_each_instruction_set_is_one_run_and_the_range_is_printed(monkeypatch, capsys):
    calls = []
    losses = {"native": ("2.3499", "0.781"), "AVX2": ("2.3811", "0.791"), "SSE4_2": ("2.3102", "0.768")}

    def fake_run(cmd, env, **_):
        isa = env.get("XLA_FLAGS", "native").rpartition("=")[2]
        calls.append((isa, cmd))
        loss, ratio = losses[isa]
        return subprocess.CompletedProcess(
            cmd, 0, stdout="", stderr=f"step 0: ...\n{LINE.format(loss=loss, ratio=ratio)}"
        )

    monkeypatch.setattr(loss_range.subprocess, "run", fake_run)
    assert loss_range.main(["train.steps=2"]) == 0
    assert [isa for isa, _ in calls] == ["native", "AVX2", "SSE4_2"]
    assert all("--cpu-devices" in cmd and cmd[-1] == "train.steps=2" for _, cmd in calls)
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "AVX2     final val_loss 2.3811 nats/token, unigram entropy 3.0085, ratio 0.791"
    assert out[-1] == "range: val_loss 2.3102 to 2.3811, ratio 0.768 to 0.791 (3 instruction sets)"

    def failed(cmd, env, **_):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback ...\nValueError: boom")

    monkeypatch.setattr(loss_range.subprocess, "run", failed)
    assert loss_range.main(["--isa", "AVX2"]) == 1
    assert "AVX2: jaxpar-train exited 1, no final val_loss" in capsys.readouterr().err
