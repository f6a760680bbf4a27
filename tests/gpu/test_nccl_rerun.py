"""``--rerun-mode validate_results`` over NCCL (two ranks on one GPU, data parallel with the
distributed optimizer): the flag reductions, the gathered failures and the saves run on CUDA
tensors there. A reproduced fault saves and exits 16 on every rank; resumed on "another node"
(``socket.gethostname`` answering another name) the job exits 17 naming a persistent fault;
a transient fault exits 17 at once."""

import sys

from tests.distributed.test_trainer import small_gpt
from tests.gpu.nccl_support import BACKEND, REPO, launch, needs

pytestmark = needs(BACKEND)

PRETRAIN = REPO / "pretrain_gpt.py"


def _job(data, tmp_path, *extra, script=PRETRAIN, name="run"):
    args = small_gpt(data, "--train-iters", "4", "--eval-iters", "0",
                     "--use-distributed-optimizer", "--rerun-mode", "validate_results",
                     "--error-injection-rate", "1", *extra)
    args[args.index("--distributed-backend") + 1] = BACKEND
    return launch([sys.executable, str(script), *args], 2, timeout_s=240,
                  log_dir=tmp_path / name)


def test_a_persistent_fault_over_nccl(data, tmp_path):
    save = ["--error-injection-type", "persistent_error", "--save", str(tmp_path / "ckpt")]
    first = _job(data, tmp_path, *save)
    assert first.returncodes == [16, 16], first.describe()
    assert "Saving a checkpoint and exiting now" in first.combined
    other = tmp_path / "on_another_node.py"
    other.write_text("import runpy, socket, sys\nsocket.gethostname = lambda: 'another-node'\n"
                     f"sys.argv[0] = {str(PRETRAIN)!r}\n"
                     f"runpy.run_path({str(PRETRAIN)!r}, run_name='__main__')\n")
    second = _job(data, tmp_path, *save, "--load", str(tmp_path / "ckpt"), script=other,
                  name="resumed")
    assert second.returncodes == [17, 17], second.describe()
    assert "Possible persistent error!!" in second.combined


def test_a_transient_fault_over_nccl(data, tmp_path):
    launched = _job(data, tmp_path, "--error-injection-type", "transient_error")
    assert launched.returncodes == [17, 17], launched.describe()
    assert "Possible transient error!!" in launched.combined
