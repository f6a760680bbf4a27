"""SIGTERM (torchrun's teardown, a scheduler) makes a pipeline rank write its flight record, even
while its main thread is blocked; a SIGTERM handler of the program's own is left alone."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RANK = textwrap.dedent("""
    import signal, sys, threading
    from megatron.core.pipeline_parallel import flight_recorder
    if sys.argv[2] == "own-handler":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    recorder = flight_recorder.get_flight_recorder()
    recorder.rank = 0
    recorder.record(call=1, op="recv_prev", peer=1, peer_pipeline_rank=1, kind="activation",
                    microbatch=0, src_stage=0, dst_stage=1, shape=[4], dtype="torch.float32",
                    done=lambda: False)
    flight_recorder.start_watchdog(600.0, sys.argv[1])
    if sys.argv[2] == "dumping":  # SIGTERM while the main thread writes the record of an error
        import json, time
        write = json.dump
        def slow_write(*args, **kwargs):
            print("ready", flush=True)
            time.sleep(1.0)
            write(*args, **kwargs)
        json.dump = slow_write
        recorder.dump_for_error(RuntimeError("a peer ended"))
    else:
        print("ready", flush=True)
    threading.Event().wait()  # blocked, as in a transport wait
""")


def _start(tmp_path, mode):
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), mode], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("SIGTERM did not end the rank")
    return proc.returncode, output


def test_sigterm_writes_the_record_and_exits(tmp_path):
    returncode, output = _start(tmp_path, "default")
    assert returncode == 128 + signal.SIGTERM, output
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["reason"].startswith("SIGTERM")
    assert record["records"][0]["completed_s"] is None
    assert f"flight record: {tmp_path / 'rank0.json'}" in output


def test_a_handler_of_the_programs_own_keeps_sigterm(tmp_path):
    returncode, _ = _start(tmp_path, "own-handler")
    assert returncode == 7
    assert not (tmp_path / "rank0.json").exists()


def test_sigterm_while_the_record_of_an_error_is_written_leaves_that_record_whole(tmp_path):
    # torchrun's SIGTERM reaches a survivor as its failed wait writes the record: the watchdog
    # lets that record be finished and written once, then exits; no half-written file stays.
    returncode, output = _start(tmp_path, "dumping")
    assert returncode == 128 + signal.SIGTERM, output
    assert os.listdir(tmp_path) == ["rank0.json"]
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert "a peer ended" in record["reason"]
