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


def _spawned(local_rank, body, world, args):
    """A rank started by `run_ranks`: rendezvous on this host, then the program's body."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    body(local_rank, world, local_rank, args)


def run_ranks(body, args, program):
    """Runs `body(rank, world, local_rank, args)` as one rank of a job: under torchrun (RANK and WORLD_SIZE set) this
    process is that rank; otherwise it starts `args.world` ranks itself (torch.multiprocessing, spawn, same
    environment), after checking that many GPUs are visible (exit 2 if not)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        body(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), args)
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.world:
        print(f"{program}: {args.world} GPUs asked for, {torch.cuda.device_count()} visible", file=sys.stderr)
        sys.exit(2)
    import torch.multiprocessing as mp
    mp.spawn(_spawned, args=(body, args.world, args), nprocs=args.world, join=True)


def report_ranks(rank, world, mine, steps, seconds):
    """Gathers every rank's `{key: digest}` to rank 0, which prints them as `result rank<r>-<key>` lines, then
    `steps`, `step_us` (median of `seconds`) and `mean_us`."""
    import statistics
    import torch.distributed as dist
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for r, results in enumerate(everyone):
            for key, digest in results.items():
                print(f"result rank{r}-{key} {digest}")
        print(f"steps {steps}")
        print(f"step_us {statistics.median(seconds) * 1e6:.3f}")
        print(f"mean_us {statistics.mean(seconds) * 1e6:.3f}")
        sys.stdout.flush()
