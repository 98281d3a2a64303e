"""What the corpus programs share: the environment set before torch loads, determinism, the device, hashing.

Imported before torch by each program (`import common` first): with `--deterministic-algorithms` it sets
CUBLAS_WORKSPACE_CONFIG, which cuBLAS reads when torch loads it.
"""

import hashlib
import os
import sys

# PyTorch's deterministic-algorithms mode is off unless --deterministic-algorithms is given: programs people run
# leave it off, and with it PyTorch 2.11 reads CUBLAS_WORKSPACE_CONFIG with a regex on every cuBLAS handle fetch
# (~60 us of host time each, ~130-200 us per nn.Linear call), which would swamp what is measured. The kernels these
# programs run are deterministic without it (the runner checks every run's results against the first).
DETERMINISTIC_ALGORITHMS = "--deterministic-algorithms" in sys.argv[1:]
if DETERMINISTIC_ALGORITHMS:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402


def deterministic(seed):
    """Fixed seeds, cuDNN deterministic and not benchmarking, TF32 off (and the deterministic mode if asked)."""
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if DETERMINISTIC_ALGORITHMS:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)


def pick_device(name):
    """The device `name`; exits with status 2 when CUDA is asked for and unavailable."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        program = os.path.basename(sys.argv[0])
        print(f"{program}: device {name} asked for but torch.cuda.is_available() is False", file=sys.stderr)
        sys.exit(2)
    return device


def sync(device):
    """Waits for the device's work (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensor_bytes(t):
    """A tensor's bytes, as the host sees them."""
    return t.detach().cpu().contiguous().numpy().tobytes()


def sha256(data):
    """The hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()
