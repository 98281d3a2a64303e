//! `apex`: what a launch library needs to know about the GPUs here, the launch-latency benchmark, the CUDA
//! tracer, a runner for programs under the APEX preload and the occupancy advisor, from the command line.

use std::error::Error;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};
use std::time::Instant;

use apex::launch::occupancy::{DeviceLimits, KernelResources, advise, occupancy};
use apex::module::cubin::Cubin;
use apex::{Backend, Gpu, driver, launch, rm};
use clap::{Parser, Subcommand};
use serde_json::{Value, json};

/// The test kernels' sm_90 cubin, whose `empty` kernel the benchmark launches.
const BENCH_CUBIN: &[u8] = include_bytes!("../../kernels/apex_test_kernels.sm_90.cubin");

/// The exit codes, shown after every subcommand's help.
const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the command failed (the message says what was tried, what failed and what to do)
  2  usage error (unknown option, missing argument)
  3  no usable NVIDIA GPU or driver here (no device nodes, no libcuda, unsupported driver branch, no such GPU)
  `apex trace` and `apex run` exit with the program's status (128 + the signal when a signal killed it).";

/// Launch work on NVIDIA GPUs through the kernel driver: facts, benchmark, tracer, preload runner and
/// occupancy advisor.
#[derive(Parser, Debug)]
#[command(name = "apex", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The GPUs, driver, classes, backend choice and why, and the limits a launch must respect.
    #[command(after_help = EXIT_CODES)]
    Info {
        /// Only this GPU (default: every GPU).
        #[arg(long)]
        gpu: Option<usize>,
        /// Print JSON on stdout instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Launch latency of the direct path beside cuLaunchKernel and CUDA graphs; writes
    /// launch_latency.{txt,csv,svg}. Needs the direct path and libcuda.
    #[command(after_help = EXIT_CODES)]
    Bench {
        /// The GPU.
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Directory for launch_latency.txt, .csv and .svg.
        #[arg(long, default_value = ".")]
        out: PathBuf,
        /// Samples per path for the submit and launch-to-completion measures.
        #[arg(long, default_value_t = 20_000)]
        samples: usize,
        /// Rounds of 1000 dependent launches per path.
        #[arg(long, default_value_t = 200)]
        rounds: usize,
        /// Open the direct path before libcuda.
        #[arg(long)]
        direct_first: bool,
        /// Print the summary (min, median, p99, speedup per series) as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Run a program under the apex-trace LD_PRELOAD tracer: every RM/UVM ioctl, pushbuffer, QMD and
    /// cuLaunchKernel as JSON lines, and a per-kernel summary with occupancy advice.
    #[command(after_help = EXIT_CODES)]
    Trace {
        /// libapex_trace.so (default: $APEX_TRACE_LIB, else beside the apex binary or one directory up;
        /// build it with `cargo build --release -p apex-trace`).
        #[arg(long)]
        lib: Option<PathBuf>,
        /// Where the records go (JSON lines; the last line is the summary).
        #[arg(long, short, default_value = "apex-trace.jsonl")]
        out: PathBuf,
        /// SMs of the GPU, for the occupancy advice in the summary (default: the tracer's, 132).
        #[arg(long)]
        sm_count: Option<u32>,
        /// Print the summary record as JSON on stdout after the program exits.
        #[arg(long)]
        json: bool,
        /// The program and its arguments (after `--`).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Run a program under the APEX LD_PRELOAD library (libapex_preload.so), which sends its CUDA kernel
    /// launches through APEX, and print at exit what went through APEX, what fell back to libcuda and why,
    /// and the ordering hops between the two.
    #[command(after_help = EXIT_CODES)]
    Run {
        /// libapex_preload.so (default: $APEX_PRELOAD_LIB, else beside the apex binary or one directory up;
        /// build it with `cargo build --release -p apex-preload`).
        #[arg(long)]
        lib: Option<PathBuf>,
        /// Keep the preload's statistics (JSON) in this file (default: $APEX_PRELOAD_STATS if set, else
        /// temporary files, removed after the report). `%p` in the name: one file per process (its pid), for
        /// programs that start processes (torchrun); every process that launched is reported.
        #[arg(long)]
        stats: Option<PathBuf>,
        /// Forward everything to libcuda (APEX_PRELOAD=off; launches are still counted), for A/B comparisons.
        #[arg(long)]
        off: bool,
        /// Print the preload's statistics as JSON on stdout after the program exits.
        #[arg(long)]
        json: bool,
        /// The preload's log level on stderr (APEX_PRELOAD_LOG: error, warn, info, debug, trace).
        #[arg(long, value_name = "LEVEL")]
        log: Option<String>,
        /// The program and its arguments (after `--`).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Occupancy and launch advice for a kernel of a cubin or fatbin, from the GPU here or, with --sm,
    /// without one.
    #[command(after_help = EXIT_CODES)]
    Occupancy {
        /// A cubin, or a fatbin holding SASS for the device.
        cubin: PathBuf,
        /// The kernel (mangled, or demangled with or without parameters).
        kernel: String,
        /// Threads per block.
        #[arg(long)]
        block: u32,
        /// Blocks in the grid (for the "too few blocks" advice; default: enough to fill the GPU).
        #[arg(long)]
        grid: Option<u64>,
        /// Dynamic shared memory per block, bytes.
        #[arg(long, default_value_t = 0)]
        dynamic_smem: u32,
        /// Compute capability as major*10+minor (80, 86, 87, 89, 90), for use without a GPU.
        #[arg(long)]
        sm: Option<u32>,
        /// SMs on the device, with --sm (default 132, an H100 SXM / H200).
        #[arg(long, default_value_t = 132)]
        sm_count: u32,
        /// The GPU to take the facts from, without --sm.
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Print JSON on stdout instead of text.
        #[arg(long)]
        json: bool,
    },
}

type Res<T> = Result<T, Box<dyn Error>>;

/// An error of the command line itself (a file, an argument), as a sentence.
#[derive(Debug)]
struct Msg(String);

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for Msg {}

/// Boxes a sentence as the command's error.
fn msg(s: impl Into<String>) -> Box<dyn Error> {
    Box::new(Msg(s.into()))
}

/// A program `apex trace` or `apex run` ran, which exited with this status; `main` exits with it too.
#[derive(Debug)]
struct ChildExit(u8);

impl std::fmt::Display for ChildExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the program exited with status {}", self.0)
    }
}

impl Error for ChildExit {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Cmd::Info { gpu, json } => info(gpu, json),
        Cmd::Bench {
            gpu,
            out,
            samples,
            rounds,
            direct_first,
            json,
        } => bench(gpu, &out, samples, rounds, direct_first, json),
        Cmd::Trace {
            lib,
            out,
            sm_count,
            json,
            command,
        } => trace(lib, &out, sm_count, json, &command),
        Cmd::Run {
            lib,
            stats,
            off,
            json,
            log,
            command,
        } => run(
            lib,
            &RunOptions {
                stats,
                off,
                json,
                log,
            },
            &command,
        ),
        Cmd::Occupancy {
            cubin,
            kernel,
            block,
            grid,
            dynamic_smem,
            sm,
            sm_count,
            gpu,
            json,
        } => occupancy_cmd(
            &cubin,
            &kernel,
            block,
            grid,
            dynamic_smem,
            sm.map(|s| (s, sm_count)),
            gpu,
            json,
        ),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(c) = e.downcast_ref::<ChildExit>() {
                return ExitCode::from(c.0);
            }
            eprintln!("error: {}", apex::error_report(e.as_ref()));
            ExitCode::from(exit_code(e.as_ref()))
        }
    }
}

/// 3 when the machine has no usable GPU or driver, else 1.
fn exit_code(e: &(dyn Error + 'static)) -> u8 {
    let no_gpu = if let Some(e) = e.downcast_ref::<apex::Error>() {
        api_no_gpu(e)
    } else if let Some(e) = e.downcast_ref::<launch::Error>() {
        launch_no_gpu(e)
    } else if let Some(e) = e.downcast_ref::<rm::Error>() {
        rm_no_gpu(e)
    } else if let Some(e) = e.downcast_ref::<driver::Error>() {
        driver_no_gpu(e)
    } else {
        false
    };
    if no_gpu { 3 } else { 1 }
}

fn api_no_gpu(e: &apex::Error) -> bool {
    match e {
        apex::Error::NoBackend { .. } | apex::Error::DirectUnavailable(_) => true,
        apex::Error::Direct(l) => launch_no_gpu(l),
        apex::Error::Driver(d) => driver_no_gpu(d),
        _ => false,
    }
}

fn launch_no_gpu(e: &launch::Error) -> bool {
    use apex::gpfifo::Error as G;
    use apex::pushbuf::Error as P;
    match e {
        launch::Error::Queue(P::Channel(G::Rm(r))) => rm_no_gpu(r),
        launch::Error::Unsupported(_) => true,
        _ => false,
    }
}

fn rm_no_gpu(e: &rm::Error) -> bool {
    matches!(
        e,
        rm::Error::NoDeviceNode { .. }
            | rm::Error::PermissionDenied { .. }
            | rm::Error::DriverBranch { .. }
            | rm::Error::NoSuchGpu { .. }
            | rm::Error::UnsupportedClass { .. }
    )
}

fn driver_no_gpu(e: &driver::Error) -> bool {
    // CUDA_ERROR_NO_DEVICE, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INSUFFICIENT_DRIVER.
    matches!(e, driver::Error::NoLibrary)
        || matches!(
            e,
            driver::Error::Call {
                code: 100 | 101 | 35,
                ..
            }
        )
}

/// Progress of a long run, on stderr, with the time since the start.
fn progress(start: Instant) -> impl FnMut(&str) {
    move |what| eprintln!("[{:>6.1} s] {what}", start.elapsed().as_secs_f64())
}

// ---------------------------------------------------------------------------------------------- info

fn info(only: Option<usize>, json: bool) -> Res<()> {
    let mut gpus = Vec::new();
    let indices: Box<dyn Iterator<Item = usize>> = match only {
        Some(i) => Box::new(std::iter::once(i)),
        None => Box::new(0..),
    };
    for index in indices {
        let gpu = match Gpu::open(index) {
            Ok(g) => g,
            // Past the last GPU: both backends say the index does not exist.
            Err(e) if only.is_none() && index > 0 && is_past_last(&e) => break,
            Err(e) => return Err(e.into()),
        };
        gpus.push(gpu_facts(index, &gpu)?);
    }
    let kernel_module = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|v| v.lines().next().map(str::to_owned));
    let cuda = cuda_facts();
    let doc = json!({
        "kernel_module": kernel_module,
        "cuda_driver": cuda,
        "gpus": gpus,
    });
    if json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    if let Some(m) = &kernel_module {
        println!("kernel module: {m}");
    }
    match &cuda {
        Value::Object(o) if o.get("version").is_some_and(|v| !v.is_null()) => {
            println!("CUDA driver (libcuda): API version {}", o["version"])
        }
        _ => println!("CUDA driver (libcuda): not loadable"),
    }
    for g in &gpus {
        print_gpu(g);
    }
    Ok(())
}

fn is_past_last(e: &apex::Error) -> bool {
    match e {
        apex::Error::NoBackend { driver, direct, .. } => {
            matches!(driver, driver::Error::Call { code: 101, .. })
                || direct.to_string().contains("out of range")
        }
        apex::Error::Driver(driver::Error::Call { code: 101, .. }) => true,
        _ => e.to_string().contains("out of range"),
    }
}

fn cuda_facts() -> Value {
    if !driver::is_available() {
        return json!({ "available": false, "version": null });
    }
    // The API version needs a context of some GPU; any failure just leaves it unknown.
    let version = driver::Context::new(0)
        .ok()
        .and_then(|c| c.driver_version().ok());
    json!({ "available": true, "version": version })
}

fn gpu_facts(index: usize, gpu: &Gpu) -> Res<Value> {
    let i = gpu.info();
    let sel = gpu.selection();
    let l = gpu.limits();
    let mut v = json!({
        "index": index,
        "name": i.name,
        "sm": i.sm_version,
        "sm_count": i.sm_count,
        "memory_bytes": i.memory_bytes,
        "backend": match sel.backend { Backend::Direct => "direct", Backend::Driver => "driver" },
        "backend_reason": sel.to_string(),
        "fallback": sel.fallback.as_ref().map(ToString::to_string),
        "limits": {
            "max_grid": l.max_grid,
            "max_block": l.max_block,
            "max_threads_per_block": l.max_threads_per_block,
            "max_shared_per_block": l.max_shared_per_block,
            "registers_per_sm": l.registers_per_sm,
            "max_param_bytes": l.max_param_bytes,
            "max_cluster_blocks": l.max_cluster_blocks,
        },
    });
    if let Some(d) = DeviceLimits::for_sm(i.sm_version, i.sm_count) {
        v["sm_limits"] = json!({
            "max_warps_per_sm": d.max_warps_per_sm,
            "max_blocks_per_sm": d.max_blocks_per_sm,
            "regs_per_sm": d.regs_per_sm,
            "max_regs_per_thread": d.max_regs_per_thread,
            "smem_per_sm": d.smem_per_sm,
            "smem_per_block": d.smem_per_block,
            "smem_per_block_optin": d.smem_per_block_optin,
            "reserved_smem_per_block": d.reserved_smem_per_block,
            "carveouts_kib": d.carveouts_kib,
        });
    }
    if let Some(core) = gpu.direct() {
        let c = core.info();
        v["uuid"] = json!(c.uuid);
        v["pci_bus_id"] = json!(c.pci_bus_id);
        v["driver_version"] = json!(c.driver_version);
        v["gpc_count"] = json!(c.gpc_count);
        v["tpc_count"] = json!(c.tpc_count);
        v["sms_per_tpc"] = json!(c.sms_per_tpc);
        v["max_warps_per_sm"] = json!(c.max_warps_per_sm);
        v["classes"] = json!(
            core.classes()
                .iter()
                .map(|c| format!("{c:#06x}"))
                .collect::<Vec<_>>()
        );
        // The classes APEX's channel binds: the ones a launch goes through.
        let mut q = gpu.queue()?;
        if let Some(cq) = q.direct() {
            let cl = cq.queue().channel().classes();
            v["channel_classes"] = json!({
                "gpfifo": format!("{:#06x}", cl.gpfifo),
                "compute": cl.compute.map(|c| format!("{c:#06x}")),
                "copy": cl.copy.map(|c| format!("{c:#06x}")),
            });
        }
    }
    Ok(v)
}

fn print_gpu(g: &Value) {
    let s = |k: &str| g.get(k).cloned().unwrap_or(Value::Null);
    println!(
        "GPU {}: {} (sm_{}, {} SMs, {} GiB)",
        s("index"),
        s("name").as_str().unwrap_or("?"),
        s("sm"),
        s("sm_count"),
        s("memory_bytes").as_u64().unwrap_or(0) >> 30
    );
    if let Some(u) = g.get("uuid") {
        println!(
            "  {} at PCI {}, driver {}",
            u.as_str().unwrap_or("?"),
            s("pci_bus_id").as_str().unwrap_or("?"),
            s("driver_version").as_str().unwrap_or("?")
        );
        println!(
            "  {} GPCs, {} TPCs, {} SMs/TPC, {} warps/SM",
            s("gpc_count"),
            s("tpc_count"),
            s("sms_per_tpc"),
            s("max_warps_per_sm")
        );
    }
    println!("  backend: {}", s("backend_reason").as_str().unwrap_or("?"));
    if let Some(c) = g.get("channel_classes") {
        println!(
            "  channel classes: gpfifo {}, compute {}, copy {}",
            c["gpfifo"], c["compute"], c["copy"]
        );
    }
    if let Some(Value::Array(cl)) = g.get("classes") {
        let names: Vec<&str> = cl.iter().filter_map(Value::as_str).collect();
        println!("  {} classes: {}", names.len(), names.join(" "));
    }
    let l = &g["limits"];
    println!(
        "  limits: grid {}, block {}, {} threads/block, {} B shared/block, {} registers/SM, {} B of parameters, clusters up to {} blocks",
        l["max_grid"],
        l["max_block"],
        l["max_threads_per_block"],
        l["max_shared_per_block"],
        l["registers_per_sm"],
        l["max_param_bytes"],
        l["max_cluster_blocks"]
    );
    if let Some(d) = g.get("sm_limits") {
        println!(
            "  per SM: {} warps, {} blocks, {} registers (≤ {}/thread), {} B shared (carveouts {} KiB); {} B shared/block by default, {} opted in",
            d["max_warps_per_sm"],
            d["max_blocks_per_sm"],
            d["regs_per_sm"],
            d["max_regs_per_thread"],
            d["smem_per_sm"],
            d["carveouts_kib"],
            d["smem_per_block"],
            d["smem_per_block_optin"]
        );
    }
}

// --------------------------------------------------------------------------------------------- bench

fn bench(
    gpu: usize,
    out: &Path,
    samples: usize,
    rounds: usize,
    direct_first: bool,
    json: bool,
) -> Res<()> {
    std::fs::create_dir_all(out).map_err(|e| {
        msg(format!(
            "cannot create the output directory {}: {e}",
            out.display()
        ))
    })?;
    let opts = apex::bench::LatencyOptions {
        gpu,
        samples,
        rounds,
        direct_first,
        ..Default::default()
    };
    let report =
        apex::bench::launch_latency(BENCH_CUBIN, "empty", &opts, &mut progress(Instant::now()))?;
    let table = report.table();
    let write = |name: &str, text: &str| -> Res<()> {
        let p = out.join(name);
        std::fs::write(&p, text).map_err(|e| msg(format!("cannot write {}: {e}", p.display())))
    };
    write("launch_latency.txt", &table)?;
    write("launch_latency.csv", &report.csv())?;
    write("launch_latency.svg", &report.svg())?;
    if json {
        let series: Vec<Value> = report
            .series
            .iter()
            .map(|s| {
                let (min, median, p99) = s.stats();
                json!({
                    "measure": s.measure, "path": s.path, "samples": s.ns.len(),
                    "min_ns": min, "median_ns": median, "p99_ns": p99,
                    "speedup_vs_cuLaunchKernel": report.speedup(s),
                })
            })
            .collect();
        let doc = json!({ "device": report.device, "series": series, "out": out });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!("{}", report.device);
        print!("{table}");
        println!("wrote {}/launch_latency.{{txt,csv,svg}}", out.display());
    }
    Ok(())
}

// ---------------------------------------------------------------------- programs under a preload library

/// An LD_PRELOAD library of this workspace that `apex` runs programs under: how to find it and how to build it.
struct PreloadLib {
    /// Its file name.
    file: &'static str,
    /// The environment variable that may name it.
    env: &'static str,
    /// What it is, for messages.
    what: &'static str,
    /// The package that builds it, for the build hint.
    package: &'static str,
}

/// apex-trace's library, for `apex trace`.
const TRACER: PreloadLib = PreloadLib {
    file: "libapex_trace.so",
    env: "APEX_TRACE_LIB",
    what: "the tracer library",
    package: "apex-trace",
};

/// apex-preload's library, for `apex run`.
const PRELOAD: PreloadLib = PreloadLib {
    file: "libapex_preload.so",
    env: "APEX_PRELOAD_LIB",
    what: "the preload library",
    package: "apex-preload",
};

/// `lib`'s file: `given` (`--lib`), its environment variable, beside this binary, or one directory up (cargo's
/// `target/release/` when this binary is under `deps/`).
fn find_lib(lib: &PreloadLib, given: Option<PathBuf>) -> Res<PathBuf> {
    let named = given.map(|p| (p, "--lib".to_string())).or_else(|| {
        std::env::var_os(lib.env)
            .filter(|v| !v.is_empty())
            .map(|v| (PathBuf::from(v), format!("${}", lib.env)))
    });
    if let Some((p, from)) = named {
        return if p.is_file() {
            Ok(std::fs::canonicalize(&p).unwrap_or(p))
        } else {
            Err(msg(format!(
                "{} {} (from {from}) does not exist; build it with `cargo build --release -p {}` and pass its path with --lib",
                lib.what,
                p.display(),
                lib.package
            )))
        };
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidates = [dir.join(lib.file), dir.join("..").join(lib.file)];
    candidates
        .iter()
        .find(|p| p.is_file())
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
        .ok_or_else(|| {
            msg(format!(
                "{} was not found beside the apex binary ({}); build it with `cargo build --release -p {}` \
                 (it lands in target/release/) or pass its path with --lib",
                lib.file,
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                lib.package
            ))
        })
}

/// The program and its arguments; clap requires one, this keeps an empty list an error rather than a panic.
fn split_command(command: &[String]) -> Res<(&str, &[String])> {
    command
        .split_first()
        .map(|(p, a)| (p.as_str(), a))
        .ok_or_else(|| msg("no program to run; give one after `--`"))
}

/// Removes what an earlier run left at `path`: the library writes the file only when the program touches the
/// GPU, so a stale one must not pass for this run's. `flag` is the option that chooses another file.
fn remove_stale(path: &Path, flag: &str) -> Res<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(msg(format!(
            "cannot replace {}: {e}; choose another file with {flag}",
            path.display()
        ))),
        _ => Ok(()),
    }
}

/// Runs `program` with `lib` first in LD_PRELOAD (before any library the user preloads already) and `env` set.
fn run_preloaded(
    lib: &Path,
    program: &str,
    args: &[String],
    env: &[(&str, OsString)],
) -> Res<ExitStatus> {
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", lib.display()),
        _ => lib.display().to_string(),
    };
    Command::new(program)
        .args(args)
        .env("LD_PRELOAD", preload)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .status()
        .map_err(|e| {
            msg(format!(
                "cannot run {program}: {e}; check the program's path and that it is executable"
            ))
        })
}

/// The program's exit status as this command's: its code, or 128 + the signal that killed it (the shell's
/// convention), said on stderr after `tool:` since no code of the program's own explains it.
fn pass_status(tool: &str, program: &str, status: ExitStatus) -> Res<()> {
    match status.code() {
        Some(0) => Ok(()),
        Some(c) => Err(Box::new(ChildExit(u8::try_from(c).unwrap_or(1)))),
        None => {
            use std::os::unix::process::ExitStatusExt;
            let sig = status.signal().unwrap_or(0);
            eprintln!("{tool}: {program} was killed by signal {sig}");
            Err(Box::new(ChildExit(u8::try_from(128 + sig).unwrap_or(1))))
        }
    }
}

// --------------------------------------------------------------------------------------------- trace

/// `apex trace`: runs the program under the tracer, then says where the records and summary are.
fn trace(
    lib: Option<PathBuf>,
    out: &Path,
    sm_count: Option<u32>,
    json: bool,
    command: &[String],
) -> Res<()> {
    let lib = find_lib(&TRACER, lib)?;
    let (program, args) = split_command(command)?;
    remove_stale(out, "--out")?;
    let mut env = vec![("APEX_TRACE_FILE", out.as_os_str().to_owned())];
    if let Some(n) = sm_count {
        env.push(("APEX_TRACE_SM_COUNT", n.to_string().into()));
    }
    eprintln!(
        "apex trace: running {program} under {} (records to {})",
        lib.display(),
        out.display()
    );
    let status = run_preloaded(&lib, program, args, &env)?;
    let summary = std::fs::read_to_string(out)
        .ok()
        .and_then(|t| t.lines().last().map(str::to_owned))
        .and_then(|l| serde_json::from_str::<Value>(&l).ok())
        .filter(|v| v["type"] == "summary");
    match (&summary, json) {
        (Some(s), true) => println!("{}", serde_json::to_string_pretty(s)?),
        (None, _) => eprintln!(
            "apex trace: the program made no NVIDIA GPU call the tracer saw, so {} holds no summary",
            out.display()
        ),
        (Some(_), false) => eprintln!(
            "apex trace: records and summary (last line) in {}",
            out.display()
        ),
    }
    pass_status("apex trace", program, status)
}

// ----------------------------------------------------------------------------------------------- run

/// `apex run`'s options besides the library and the program.
struct RunOptions {
    /// `--stats`: where the statistics go, kept.
    stats: Option<PathBuf>,
    /// `--off`: APEX_PRELOAD=off.
    off: bool,
    /// `--json`: the statistics on stdout.
    json: bool,
    /// `--log`: APEX_PRELOAD_LOG.
    log: Option<String>,
}

/// `apex run`: runs the program under the preload, reports its statistics on stderr and passes its exit status
/// through.
fn run(lib: Option<PathBuf>, o: &RunOptions, command: &[String]) -> Res<()> {
    let lib = find_lib(&PRELOAD, lib)?;
    let (program, args) = split_command(command)?;
    // --stats, else the user's own APEX_PRELOAD_STATS (both kept), else a file of ours removed after the report.
    let kept = o.stats.clone().or_else(|| {
        std::env::var_os("APEX_PRELOAD_STATS")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    let temporary = kept.is_none();
    // Ours: a private directory with one summary per process (`%p`), so every process of a job started under
    // the program (torchrun's ranks, multiprocessing workers) is reported, not whichever wrote last.
    let dir = std::env::temp_dir().join(format!("apex-run-{}", std::process::id()));
    let stats = kept.unwrap_or_else(|| dir.join("stats-%p.json"));
    if temporary {
        use std::os::unix::fs::DirBuilderExt;
        // Made here, owner-only and refusing an existing path (a link someone planted included).
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| {
                msg(format!(
                    "cannot create the statistics directory {}: {e}; choose a file with --stats",
                    dir.display()
                ))
            })?;
    } else {
        for stale in summary_files(&stats) {
            remove_stale(&stale, "--stats")?;
        }
    }
    let mut env = vec![("APEX_PRELOAD_STATS", stats.as_os_str().to_owned())];
    if o.off {
        env.push(("APEX_PRELOAD", "off".into()));
    }
    if let Some(level) = &o.log {
        env.push(("APEX_PRELOAD_LOG", level.into()));
    }
    eprintln!(
        "apex run: running {program} under {}{}{}",
        lib.display(),
        if o.off {
            " with APEX_PRELOAD=off (every launch forwarded to libcuda, still counted)"
        } else {
            ""
        },
        if temporary {
            String::new()
        } else {
            format!(" (statistics kept in {})", stats.display())
        }
    );
    let status = run_preloaded(&lib, program, args, &env);
    let mut read = Vec::new();
    for file in summary_files(&stats) {
        match std::fs::read_to_string(&file) {
            Ok(text) if text.trim().is_empty() => {}
            Ok(text) => match serde_json::from_str::<Value>(&text) {
                Ok(v) => read.push((file, v)),
                Err(e) => eprintln!(
                    "apex run: {} does not hold the preload's JSON statistics ({e})",
                    file.display()
                ),
            },
            Err(e) => eprintln!(
                "apex run: cannot read the statistics in {}: {e}",
                file.display()
            ),
        }
    }
    if temporary {
        // Nothing to do if it is already gone; the report does not depend on it.
        let _ = std::fs::remove_dir_all(&dir);
    }
    let status = status?;
    // Processes that made no launch (a launcher such as torchrun's) are reported only when nothing else is.
    let launched = |v: &Value| v.get("launches").and_then(Value::as_u64).unwrap_or(0) > 0;
    if read.iter().any(|(_, v)| launched(v)) {
        read.retain(|(_, v)| launched(v));
    }
    match read.as_slice() {
        [] if status.code().is_none() => eprintln!(
            "apex run: no statistics: the program was killed before the preload could write them"
        ),
        // The preload writes them at exit, and only once the program used CUDA.
        [] => eprintln!(
            "apex run: the program made no CUDA launch the preload saw (or the preload was not loaded), so there are no statistics"
        ),
        [(_, v)] => {
            if o.json {
                println!("{}", serde_json::to_string_pretty(v)?);
            }
            for line in stats_report(v) {
                eprintln!("apex run: {line}");
            }
        }
        several => {
            if o.json {
                let all: Vec<&Value> = several.iter().map(|(_, v)| v).collect();
                println!("{}", serde_json::to_string_pretty(&all)?);
            }
            eprintln!("apex run: {} processes made CUDA launches", several.len());
            for (file, v) in several {
                let name = file
                    .file_stem()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                eprintln!("apex run: process {}:", name.trim_start_matches("stats-"));
                for line in stats_report(v) {
                    eprintln!("apex run:   {line}");
                }
            }
        }
    }
    pass_status("apex run", program, status)
}

/// The summary files the preload writes for `APEX_PRELOAD_STATS=pattern`: `pattern` itself, or, where its file name
/// holds `%p` (one file per process), every file of its directory that the name matches with `%p` standing for
/// anything, in name order.
fn summary_files(pattern: &Path) -> Vec<PathBuf> {
    let name = pattern
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Some((prefix, suffix)) = name.split_once("%p") else {
        return if pattern.exists() {
            vec![pattern.to_path_buf()]
        } else {
            Vec::new()
        };
    };
    let dir = match pattern.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.len() >= prefix.len() + suffix.len()
                    && n.starts_with(prefix)
                    && n.ends_with(suffix)
            })
        })
        .collect();
    files.sort();
    files
}

/// `n` with the singular or plural noun.
fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The preload's statistics as lines: the fields this version knows in sentences, then every other top-level
/// field as `name: value`, so fields added to the preload show without a change here. A known field of an
/// unexpected type is shown as an unknown one rather than dropped.
fn stats_report(v: &Value) -> Vec<String> {
    let Some(obj) = v.as_object() else {
        return vec![format!(
            "the statistics are {v}, not the JSON object the preload writes"
        )];
    };
    let num = |k: &str| obj.get(k).and_then(Value::as_u64);
    let mut used: Vec<&str> = Vec::new();
    let mut lines = Vec::new();
    if let (Some(total), Some(apex), Some(fallback)) =
        (num("launches"), num("apex"), num("fallback"))
    {
        used.extend(["launches", "apex", "fallback"]);
        // Launches left to libcuda before APEX took their stream over (its takeover not earned yet, or APEX being set
        // up in the background): not fallbacks.
        let warmup = num("warmup");
        if warmup.is_some() {
            used.push("warmup");
        }
        lines.push(if total == 0 {
            "no kernel launches".to_string()
        } else {
            let pct = apex as f64 * 100.0 / total as f64;
            let warm = match warmup {
                Some(w) if w > 0 => {
                    format!(", {w} on libcuda before APEX took their stream over")
                }
                _ => String::new(),
            };
            format!(
                "{}: {apex} through APEX ({pct:.1}%), {fallback} fell back to libcuda{warm}",
                count(total, "kernel launch", "kernel launches")
            )
        });
    }
    if let Some(line) = obj.get("setup").and_then(setup_line) {
        used.push("setup");
        lines.push(line);
    }
    if let Some(reasons) = obj.get("reasons").and_then(Value::as_object) {
        used.push("reasons");
        let mut rs: Vec<(&String, &Value)> = reasons.iter().collect();
        let n = |r: &Value| r.get("launches").and_then(Value::as_u64);
        // Largest first; ties by label, so the order is the same every run.
        rs.sort_by(|a, b| n(b.1).cmp(&n(a.1)).then_with(|| a.0.cmp(b.0)));
        if !rs.is_empty() {
            lines.push("fell back, by reason:".to_string());
        }
        for (label, r) in rs {
            lines.push(match (n(r), r.get("example").and_then(Value::as_str)) {
                (Some(k), Some(ex)) => {
                    format!("  {label}: {}, e.g. {ex}", count(k, "launch", "launches"))
                }
                (Some(k), None) => format!("  {label}: {}", count(k, "launch", "launches")),
                _ => format!("  {label}: {r}"),
            });
        }
    }
    let hops = [
        (
            "hops_to_cuda",
            "to CUDA (a stream waited for an APEX queue)",
        ),
        ("hops_to_apex", "to APEX (a queue waited for a CUDA stream)"),
        ("hops_between_queues", "between APEX queues on the GPU"),
        ("cpu_syncs", "waited on the CPU (the GPU-side wait failed)"),
    ];
    let parts: Vec<String> = hops
        .iter()
        .filter_map(|&(k, words)| {
            let n = num(k)?;
            used.push(k);
            Some(format!("{n} {words}"))
        })
        .collect();
    if !parts.is_empty() {
        lines.push(format!("hops: {}", parts.join(", ")));
    }
    let sizes = [
        ("queues", "APEX queues built"),
        ("queues_reassigned", "queues handed to another stream"),
        ("modules_seen", "modules seen"),
        ("modules_loaded", "modules loaded by APEX"),
    ];
    let parts: Vec<String> = sizes
        .iter()
        .filter_map(|&(k, words)| {
            let n = num(k)?;
            used.push(k);
            Some(format!("{words}: {n}"))
        })
        .collect();
    if !parts.is_empty() {
        lines.push(parts.join(", "));
    }
    if let Some(a) = obj.get("attach").and_then(Value::as_str) {
        used.push("attach");
        lines.push(format!("attach to the CUDA context: {a}"));
    }
    for (k, val) in obj {
        if used.contains(&k.as_str()) {
            continue;
        }
        lines.push(match val {
            Value::String(s) => format!("{k}: {s}"),
            other => format!("{k}: {other}"),
        });
    }
    lines
}

/// The preload's set-up (its `setup` object) in one line: where it ran, and each kind of piece's count and time.
/// `None` when the object is not what the preload writes (then it is shown as an unknown field).
fn setup_line(v: &Value) -> Option<String> {
    let mode = v.get("mode")?.as_str()?;
    let mut parts = Vec::new();
    for (k, one, many) in [
        ("attach", "attach", "attaches"),
        ("queue", "queue", "queues"),
        ("module", "module", "modules"),
    ] {
        let p = v.get(k)?;
        let n = p.get("count")?.as_u64()?;
        let ms = p.get("total_ms")?.as_f64()?;
        if n > 0 {
            parts.push(format!("{} in {ms:.1} ms", count(n, one, many)));
        }
    }
    let failed = v.get("failed").and_then(Value::as_u64).unwrap_or(0);
    if failed > 0 {
        parts.push(format!("{failed} failed"));
    }
    if let Some(ms) = v
        .get("teardown")
        .and_then(|t| t.get("total_ms"))
        .and_then(Value::as_f64)
        .filter(|ms| *ms > 0.0)
    {
        parts.push(format!("freed at the end in {ms:.1} ms"));
    }
    let what = if parts.is_empty() {
        "nothing".to_string()
    } else {
        parts.join(", ")
    };
    // The takeover policy, and the streams that never ran long enough to be worth APEX's set-up.
    let mut policy = match v.get("takeover").and_then(Value::as_str) {
        Some(p) if !p.is_empty() => format!(", takeover {p}"),
        _ => String::new(),
    };
    // What libcuda's own launches cost in the process: the saving per launch the takeovers were priced with.
    if let Some(ns) = v
        .get("libcuda_launch_ns")
        .and_then(Value::as_u64)
        .filter(|ns| *ns > 0)
    {
        policy.push_str(&format!(
            ", libcuda's launch timed at {:.1} µs",
            ns as f64 / 1000.0
        ));
    }
    let owed = match v.get("modules_owed_ms").and_then(Value::as_f64) {
        Some(ms) if ms > 0.0 => format!(", which would also load about {ms:.0} ms of modules"),
        _ => String::new(),
    };
    let unearned = match v.get("streams_not_earned").and_then(Value::as_u64) {
        Some(n) if n > 0 => format!(
            "; {} left on libcuda (too few launches to pay for a takeover{owed})",
            count(n, "stream", "streams")
        ),
        _ => String::new(),
    };
    // What the program's earlier runs advised (`APEX_PRELOAD_HISTORY`), where records are kept.
    let history = match v.get("history").and_then(Value::as_str) {
        Some(h) if !h.is_empty() && h != "off" => format!("; earlier runs: {h}"),
        _ => String::new(),
    };
    Some(format!(
        "set-up ({mode}{policy}): {what}{unearned}{history}"
    ))
}

// ----------------------------------------------------------------------------------------- occupancy

#[allow(clippy::too_many_arguments)]
fn occupancy_cmd(
    path: &Path,
    kernel: &str,
    block: u32,
    grid: Option<u64>,
    dynamic_smem: u32,
    offline: Option<(u32, u32)>,
    gpu: usize,
    json: bool,
) -> Res<()> {
    let bytes = std::fs::read(path).map_err(|e| {
        msg(format!(
            "cannot read {}: {e}; give the path of a cubin or fatbin",
            path.display()
        ))
    })?;
    let (sm, sm_count, source) = match offline {
        Some((sm, n)) => (sm, n, format!("--sm {sm}, {n} SMs")),
        None => {
            let g = Gpu::open(gpu)?;
            let i = g.info();
            (i.sm_version, i.sm_count, format!("GPU {gpu}: {}", i.name))
        }
    };
    let limits = DeviceLimits::for_sm(sm, sm_count).ok_or_else(|| {
        msg(format!(
            "the occupancy tables do not know sm_{sm}; give --sm 80, 86, 87, 89 or 90"
        ))
    })?;
    let cubin_bytes = if apex::module::fatbin::is_fatbin(&bytes) {
        apex::module::select::select_cubin(&bytes, sm)?
    } else {
        bytes
    };
    let cubin = Cubin::parse(&cubin_bytes)?;
    let k = cubin.kernel(kernel).map_err(|e| {
        let names: Vec<&str> = cubin.kernels().iter().map(|k| k.name.as_str()).collect();
        msg(format!("{e}; it holds: {}", names.join(", ")))
    })?;
    let res = KernelResources::from_kernel(k, cubin.sm_version());
    let occ = occupancy(&limits, &res, block, dynamic_smem);
    let grid_blocks = grid.unwrap_or_else(|| {
        let per_sm = occ.as_ref().map_or(1, |o| o.active_blocks.max(1));
        u64::from(sm_count) * u64::from(per_sm)
    });
    let advice = advise(&limits, &res, grid_blocks, block, dynamic_smem);
    if json {
        let doc = json!({
            "device": source,
            "kernel": k.name,
            "cubin_sm": cubin.sm_version(),
            "registers": k.registers,
            "static_shared": k.static_shared,
            "block": block,
            "grid": grid_blocks,
            "dynamic_smem": dynamic_smem,
            "occupancy": match &occ {
                Ok(o) => json!({
                    "active_blocks_per_sm": o.active_blocks,
                    "active_warps_per_sm": o.active_warps,
                    "fraction": o.fraction,
                    "limited_by": o.limiters.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "blocks_by_warps": o.by_warps,
                    "blocks_by_blocks": o.by_blocks,
                    "blocks_by_registers": o.by_registers,
                    "blocks_by_shared": o.by_shared,
                    "shared_per_block": o.shared_per_block,
                    "carveout_kib": o.carveout_kib,
                }),
                Err(e) => json!({ "error": e.to_string() }),
            },
            "advice": advice.iter().map(ToString::to_string).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "{} (sm_{} cubin, {} registers/thread, {} B static shared) on {source}",
            k.name,
            cubin.sm_version(),
            k.registers,
            k.static_shared
        );
        println!("block {block}, grid {grid_blocks}, {dynamic_smem} B dynamic shared memory");
        match &occ {
            Ok(o) => println!("occupancy: {o}"),
            Err(e) => println!("cannot launch: {e}"),
        }
        if advice.is_empty() {
            println!("advice: none, the shape is fine");
        }
        for a in &advice {
            println!("advice: {a}");
        }
    }
    // A shape that cannot launch at all is the command's failure.
    occ.map(|_| ()).map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_words_known_fields_and_lists_unknown_ones() {
        let v = json!({
            "launches": 6, "apex": 3, "fallback": 1, "warmup": 2,
            "setup": {
                "mode": "background", "failed": 0, "dropped": 0, "takeover": "earned",
                "streams_not_earned": 2, "modules_owed_ms": 212.4, "libcuda_launch_ns": 4235,
                "history": "no earlier run recorded",
                "teardown": {"count": 1, "total_ms": 8.64, "max_ms": 8.64},
                "attach": {"count": 1, "total_ms": 10.84, "max_ms": 10.84},
                "queue": {"count": 2, "total_ms": 9.5, "max_ms": 5.0},
                "module": {"count": 0, "total_ms": 0.0, "max_ms": 0.0},
            },
            "reasons": {
                "capturing": {"launches": 1, "example": "the stream is capturing"},
                "device_runtime": {"launches": 1, "example": "vprintf"},
            },
            "hops_to_cuda": 2, "hops_to_apex": 1, "cpu_syncs": 0, "hops_between_queues": 5,
            "queues": 1, "modules_seen": 2, "modules_loaded": 1, "attach": "direct",
            "asserts": 7, "note": "new", "contexts": [{"attach": "direct"}],
        });
        assert_eq!(
            stats_report(&v),
            [
                "6 kernel launches: 3 through APEX (50.0%), 1 fell back to libcuda, 2 on libcuda before APEX took \
                 their stream over",
                "set-up (background, takeover earned, libcuda's launch timed at 4.2 µs): 1 attach in 10.8 ms, 2 queues in 9.5 ms, freed at the end in \
                 8.6 ms; 2 streams left on libcuda (too few launches to pay for a takeover, which would also load \
                 about 212 ms of modules); earlier runs: no earlier run recorded",
                "fell back, by reason:",
                "  capturing: 1 launch, e.g. the stream is capturing",
                "  device_runtime: 1 launch, e.g. vprintf",
                "hops: 2 to CUDA (a stream waited for an APEX queue), 1 to APEX (a queue waited for a CUDA \
                 stream), 5 between APEX queues on the GPU, 0 waited on the CPU (the GPU-side wait failed)",
                "APEX queues built: 1, modules seen: 2, modules loaded by APEX: 1",
                "attach to the CUDA context: direct",
                "asserts: 7",
                "contexts: [{\"attach\":\"direct\"}]",
                "note: new",
            ]
        );
    }

    #[test]
    fn a_known_field_of_another_type_is_shown_not_dropped() {
        let v = json!({"launches": "many", "apex": 1, "fallback": 0, "queues": -1});
        assert_eq!(
            stats_report(&v),
            ["apex: 1", "fallback: 0", "launches: many", "queues: -1"]
        );
        assert_eq!(
            stats_report(&json!({"launches": 0, "apex": 0, "fallback": 0})),
            ["no kernel launches"]
        );
        assert_eq!(
            stats_report(&json!([1])),
            ["the statistics are [1], not the JSON object the preload writes"]
        );
    }
}
