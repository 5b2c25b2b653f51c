"""jaxpar-launch's output filter over lines captured from `jaxpar-launch -n 2 --devices-per-process 4 --
jaxpar-train configs/tiny.yaml` (with TF_CPP_MIN_LOG_LEVEL=0 for the absl INFO lines, and a failed
jax.distributed.initialize for the FATAL one): each case feeds one process's lines in order and lists the lines
shown. Compiles nothing."""

import io

import pytest

from jaxpar.cli.launch import _pump
from jaxpar.cli.output_filter import OutputFilter

GLOO_1 = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
GLOO_3 = "[Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
BAR = "\rtrain:  50%|█████     | 2/4 [00:00<00:00,  2.65step/s]"
# The banner as XLA's SlowCompilationAlarm formats it (a compile of over 2 minutes; not
# reproduced here): LOG(ERROR) << "\n" + 32 stars + "\n[Compiling module M] Very slow compile? ..." + "\n" + 32 stars.
STARS = "*" * 32
SLOW = (
    "[Compiling module jit_train_step] Very slow compile? If you want to file a bug, run with envvar "
    "XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results."
)

CASES = {
    "gloo-whole": ([GLOO_1, GLOO_1, "jaxpar: process 1/2: local devices [2048,2049,2050,2051] of 8 (cpu)"], [2]),
    # Four threads' lines interleaved: two whole, two split, and their newlines on lines of their own.
    "gloo-split": (
        [
            "[Gloo] Rank 1 is connected to [Gloo] Rank 3[Gloo] Rank 1 is connected to 3 peer ranks. Expected number "
            f"of connected peer ranks is : 3{GLOO_3}",
            "",
            "3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
            " peer ranks. Expected number of connected peer ranks is : 3",
            "[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
            "step 0: val_loss 5.5896 over 8,191 validation tokens (64 of 3,178 validation sequences)",
            "",
        ],
        [5, 6],
    ),
    # Seen from jaxpar-launch: the expected count split off onto a line of its own by another thread's write.
    "gloo-split-count": (
        [
            "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : [Gloo] Rank ",
            "1",
            "[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks is : ",
            "3",
            "step 0: loss 5.6",
        ],
        [4],
    ),
    "gloo-partial-mesh": (
        [
            "[Gloo] Rank 0 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3",
            "[Gloo] Rank 0 is NOT connected to: [3]",
        ],
        [0, 1],
    ),
    "gloo-after-progress-bar": ([f"\rtrain:   0%|          | 0/4 [00:00<?, ?step/s]{GLOO_1}"], ["\rtrain:   0%|"]),
    "absl-info": (
        [
            "I1204 00:19:27.248526    7534 pjrt_client.cc:579] PjRt-IFRT device count: total=8, addressable=4",
            "I1204 00:19:27.240280    7534 coordination_service_agent.cc:276] Polling for error from coordination "
            "service. This is a long-running RPC that will return only if an error is encountered or cancelled "
            "(e.g. due to shutdown).",
            "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
            f"{BAR}I1204 00:19:40.445405    7547 coordination_service.cc:1179] [297746559671146195] "
            "Barrier(ThreadSaveMultiHostValueHolder:set_value_start::0) has passed with status: OK",
        ],
        [BAR],
    ),
    "absl-warning-after-progress-bar": (
        [
            f"{BAR}W1204 00:19:09.033984    7352 preemption_notifier.cc:90] SIGTERM caught at "
            "2026-12-04T00:19:09.03398159+00:00"
        ],
        [BAR, "W1204 00:19:09.033984    7352 preemption_notifier.cc:90] SIGTERM caught"],
    ),
    "absl-fatal": (
        [
            "F1204 00:22:46.138123    9329 client.h:80] Terminating process because the JAX distributed service "
            "detected fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded",
            "",
            "RPC: /xla.coordination.CoordinationService/RegisterTask",
            "*** Check failure stack trace: ***",
            "    @     0x7ffa00e40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()",
        ],
        [0, 1, 2, 3, 4],
    ),
    "xla-slow-compile": (
        [
            "E1204 00:31:02.016556    7547 slow_operation_alarm.cc:73] ",
            STARS,
            SLOW,
            STARS,
            "E1204 00:34:04.368570    7547 slow_operation_alarm.cc:140] The operation took 3m2.369747s",
            "",
            STARS,
            SLOW,
            STARS,
            "step 10: loss 4.1002",
            STARS,
            "Traceback (most recent call last):",
        ],
        [9, 10, 11],
    ),
    "unknown-kept": (["", STARS, "RuntimeError: bad", "jaxpar-train: error: a config path is required"], [0, 1, 2, 3]),
}


@pytest.mark.parametrize("lines, shown", CASES.values(), ids=CASES.keys())
def test_filter_keeps_errors_and_unknown_lines_and_drops_the_libraries_chatter(lines, shown):
    """`shown`: indices of the lines kept whole, or the starts of the lines shown (pieces of glued lines)."""
    keep = OutputFilter()
    out = [text for line in lines for text in keep(line + "\n")]
    if all(isinstance(s, int) for s in shown):
        assert out == [lines[i] for i in shown]
    else:
        assert len(out) == len(shown) and all(o.startswith(s) for o, s in zip(out, shown)), out


def test_pump_prefixes_lines_and_verbose_shows_them_all():
    raw = f"{GLOO_1}\nI1204 00:19:27.248526    7534 pjrt_client.cc:579] PjRt-IFRT device count: total=8\nstep 4\n"
    shown = {}
    for verbose in (False, True):
        out = io.StringIO()
        _pump(1, io.BytesIO(raw.encode()), out, verbose)
        shown[verbose] = out.getvalue()
    assert shown[False] == "[1] step 4\n"
    assert shown[True] == "".join(f"[1] {line}\n" for line in raw.splitlines())
