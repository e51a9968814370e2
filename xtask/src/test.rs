//! `cargo xtask test`: what CI runs. Set up, check formatting, lint, run the unit tests, a short
//! fuzz run, the privileged integration tests (root: network namespaces, BPF, wireguard-go; the
//! older agents' builds, the kube-apiserver build and the fuzz runs beside them at idle
//! priority),
//! then `vm-test` on two guests: Debian's 6.1 (the legacy TC hook) and 6.12 (tcx), booted side
//! by side under qemu with the debug agent the integration tests ran (the agent is built
//! once). The guests' kernels are fetched in the background meanwhile.
//!
//! `cargo xtask test --full` runs everything: every VM guest (5.10, 6.1, 6.12, and 6.12 told
//! `--attach tc`) with the release agent, each fuzz target for [`FULL_FUZZ_SECONDS`], the
//! planner's property tests at their full case counts, the differential test on 10^6 packets
//! per program variant instead of its seeded sample, and `image --run` (the container image
//! built and run as the DaemonSet runs it). tests/README.md says which suite proves which
//! promise of the README and docs/.
//!
//! Every run ends with a table of where its time went: each step, each cargo build inside a
//! test step, each test binary (also when a step fails).

use std::{
    cell::RefCell,
    collections::VecDeque,
    ffi::OsString,
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicI32, Ordering},
        mpsc, Arc, Mutex, PoisonError,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::{fuzz, image, oldagent, setup, util, vm};

/// Seconds each fuzz target runs in `cargo xtask test` (most of the step is the build).
const FUZZ_SECONDS: u64 = 20;
/// Seconds each fuzz target runs in `cargo xtask test --full`.
const FULL_FUZZ_SECONDS: u64 = 300;
/// Packets per program variant of the differential test in `--full` (the test's own default
/// is the seeded sample CI runs).
const FULL_DIFFERENTIAL_PACKETS: u64 = 1_000_000;

#[derive(Args)]
pub struct Options {
    /// Everything: every VM guest, the long fuzz run, the full differential test and
    /// `image --run` (see tests/README.md).
    #[arg(long)]
    pub full: bool,
    /// Skip `cargo fmt --check` and `cargo clippy`.
    #[arg(long)]
    pub no_lint: bool,
    /// Skip the privileged integration tests (lint and unit tests need no root).
    #[arg(long)]
    pub unit: bool,
    /// Skip the fuzzing run of every cargo-fuzz target.
    #[arg(long)]
    pub no_fuzz: bool,
    /// Skip `image --run` in `--full`.
    #[arg(long)]
    pub no_image: bool,
    /// Skip `vm-test`.
    #[arg(long)]
    pub no_vm: bool,
    /// Seconds each fuzz target runs (default 20; 300 with --full).
    #[arg(long)]
    pub fuzz_seconds: Option<u64>,
    /// Arguments for the integration test binaries, e.g. a test name filter.
    #[arg(last = true, value_name = "TEST_ARGS")]
    pub test_args: Vec<OsString>,
}

pub fn run(options: Options) -> Result<()> {
    if options.unit && !options.test_args.is_empty() {
        bail!("arguments after `--` go to the integration tests, which --unit skips");
    }
    if !options.unit && !util::is_root() {
        bail!(
            "the integration tests need root (network namespaces, BPF, wireguard-go): run as \
             root, or pass --unit for lint and unit tests only"
        );
    }
    let timings = Timings::default();
    let result = steps(&options, &timings);
    // The table also when a step failed: it says which steps ran, and for how long.
    eprintln!("{}", timings.table());
    result?;
    eprintln!(
        "test: all steps passed in {:.1}s",
        timings.start.elapsed().as_secs_f64()
    );
    // One closing line for every test binary together.
    let (passed, failed, ignored) = timings.totals();
    println!("tests: {passed} passed, {failed} failed, {ignored} skipped");
    Ok(())
}

fn steps(options: &Options, t: &Timings) -> Result<()> {
    let root = util::workspace_root()?;
    let full = options.full;
    t.step("setup", || {
        setup::run(if options.unit {
            setup::Bpffs::IfRoot
        } else {
            setup::Bpffs::Require
        })?;
        if options.unit {
            return Ok(());
        }
        // What the VM guests and the Kubernetes source's tests need from Debian, in one go
        // here: the background jobs below then never wait on apt's lock for it.
        let mut wanted = setup::KUBE_TEST_PACKAGES.to_vec();
        if !options.no_vm {
            wanted.extend_from_slice(vm::PACKAGES);
        }
        setup::ensure_packages(&wanted)
    })?;
    // The guests' kernels come from the archive: fetched while the host builds and tests.
    let vm_options = (!options.unit && !options.no_vm).then(|| {
        if full {
            vm::Options::all()
        } else {
            // The agent that "build the agent" makes below.
            vm::Options::ci(util::target_dir(&root).join("debug").join("wgfence"))
        }
    });
    let prefetch = vm_options.clone().map(|vm_options| {
        thread::spawn(move || {
            let start = Instant::now();
            let result = vm::prefetch(&vm_options);
            (result, start.elapsed().as_secs_f64())
        })
    });
    if !options.no_lint {
        t.step("fmt", || {
            util::run(util::cargo_command(&root).args(["fmt", "--all", "--", "--check"]))?;
            // fuzz/ is a workspace of its own, which `--all` does not reach.
            util::run(util::cargo_command(&root).args([
                "fmt",
                "--manifest-path",
                "fuzz/Cargo.toml",
                "--all",
                "--",
                "--check",
            ]))
        })?;
        t.step("clippy", || {
            util::run(util::cargo_command(&root).args([
                "clippy",
                "--workspace",
                "--exclude",
                "wgfence-ebpf",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]))
        })?;
    }
    t.step("unit tests", || {
        let mut cmd = util::cargo_command(&root);
        if full {
            // The planner's property tests at their full case counts.
            cmd.env("WGFENCE_FULL_SUITE", "1");
        }
        t.cargo_test(cmd.args([
            "test",
            "--workspace",
            "--exclude",
            "wgfence-ebpf",
            "--exclude",
            "wgfence-tests",
        ]))
    })?;
    let fuzz_seconds = options.fuzz_seconds.unwrap_or(if full {
        FULL_FUZZ_SECONDS
    } else {
        FUZZ_SECONDS
    });
    if options.unit && !options.no_fuzz {
        // No integration tests to run beside: the fuzz targets in the foreground.
        t.step("cargo-fuzz", fuzz::ensure_cargo_fuzz)?;
        for target in fuzz::TARGETS {
            t.step(&format!("fuzz {target}"), || {
                fuzz::fuzz(&root, target, fuzz_seconds, true)
            })?;
        }
    }
    if !options.unit {
        // The end-to-end tests run the agent binary, which `cargo test` does not build for
        // another package's tests.
        t.step("build the agent", || {
            util::run(util::cargo_command(&root).args([
                "build",
                "--package",
                "wgfence",
                "--bin",
                "wgfence",
            ]))
        })?;
        // `cargo test -p wgfence-tests` of these test files (all of them if none).
        let integration = |names: &[&String]| {
            let mut cmd = util::cargo_command(&root);
            if full {
                cmd.env(
                    "WGFENCE_DIFF_PACKETS",
                    FULL_DIFFERENTIAL_PACKETS.to_string(),
                );
            }
            cmd.env("RUST_BACKTRACE", "1")
                .args(["test", "--package", "wgfence-tests"]);
            for name in names {
                cmd.args(["--test", name]);
            }
            cmd
        };
        // The integration tests' build, alone: nothing beside it while it takes both cores.
        t.step("build the integration tests", || {
            util::run(integration(&[]).args(["--no-run"]))
        })?;
        // The upgrade tests' older agents, the Kubernetes source's API server and the fuzz
        // runs need only spare CPU: they run at idle priority beside the integration tests,
        // which wait on namespaces, sessions and packets much of the time. The first come
        // first: the tests that need them run last and wait for them.
        let mut jobs: Vec<Job> = oldagent::ALL
            .iter()
            .map(|agent| Job {
                name: format!("build the layout-{} agent (upgrade tests)", agent.layout),
                args: vec![format!("v{}-agent", agent.layout)],
            })
            .collect();
        jobs.push(Job {
            name: "kube-apiserver (Kubernetes source tests)".to_owned(),
            args: vec!["kube-apiserver".to_owned()],
        });
        let first = jobs.len();
        if !options.no_fuzz {
            // A run of each target from the committed corpus: a regression in the parser or
            // the planner that the corpus reaches fails here.
            // Without AddressSanitizer in the CI suite: the targets' code is safe Rust, and the
            // sanitizer's build and runtime cost most of the step. `--full` fuzzes under it.
            jobs.extend(fuzz::TARGETS.iter().map(|target| {
                let seconds = fuzz_seconds.to_string();
                let mut args: Vec<String> = ["fuzz", target, "--seconds", &seconds]
                    .map(str::to_owned)
                    .to_vec();
                if !full {
                    args.push("--no-sanitizer".to_owned());
                }
                Job {
                    name: format!("fuzz {target}"),
                    args,
                }
            }));
        }
        // Before the jobs start: an error here must not leave them running.
        let files = integration_files(&root)?;
        let background = Background::start(&root, jobs, first)?;
        let (late, others): (Vec<_>, Vec<_>) = files
            .iter()
            .partition(|name| LATE_TESTS.contains(&name.as_str()));
        let result = t.step("integration tests", || {
            // With the library's and the binaries' own tests.
            let mut cmd = integration(&others);
            cmd.args(["--lib", "--bins"]);
            if !options.test_args.is_empty() {
                cmd.arg("--").args(&options.test_args);
            }
            t.cargo_test(&mut cmd)
        });
        let result = result.and_then(|()| {
            let waited = Instant::now();
            let ready = background.wait_first(t);
            t.record(
                "waiting for the older agents and the API server",
                waited.elapsed().as_secs_f64(),
                ready.is_ok(),
            );
            ready?;
            t.step(
                &format!("integration tests: {}", LATE_TESTS.join(", ")),
                || {
                    let mut cmd = integration(&late);
                    for agent in oldagent::ALL {
                        cmd.env(agent.env, agent.binary(&root));
                    }
                    if !options.test_args.is_empty() {
                        cmd.arg("--").args(&options.test_args);
                    }
                    t.cargo_test(&mut cmd)
                },
            )
        });
        let waited = Instant::now();
        let rest = background.finish(t, result.is_err());
        if result.is_ok() {
            t.record(
                "waiting for the fuzz runs",
                waited.elapsed().as_secs_f64(),
                rest.is_ok(),
            );
        }
        result?;
        rest?;
    }
    if let Some(prefetch) = prefetch {
        let (result, seconds) = prefetch
            .join()
            .map_err(|_| anyhow::anyhow!("the kernel prefetch thread panicked"))?;
        t.record("vm-test kernels (fetched in the background)", seconds, true);
        result.context("fetching the guests' kernels")?;
    }
    if full && !options.unit && !options.no_image {
        t.step("image --run", || image::run(&image::Options { run: true }))?;
    }
    if let Some(vm_options) = vm_options {
        let names = vm_options.guest_names().join(", ");
        t.step(&format!("vm-test ({names})"), || vm::run(vm_options))?;
    }
    Ok(())
}

/// The integration test files that need what the first background jobs make (the older
/// agents, the API server); run after the others.
const LATE_TESTS: [&str; 2] = ["kubernetes", "upgrade"];

/// The integration test files: tests/tests/<name>.rs.
fn integration_files(root: &Path) -> Result<Vec<String>> {
    let dir = root.join("tests").join("tests");
    let mut names = Vec::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "rs") {
            if let Some(stem) = path.file_stem() {
                names.push(stem.to_string_lossy().into_owned());
            }
        }
    }
    names.sort();
    if let Some(missing) = LATE_TESTS
        .iter()
        .find(|late| !names.iter().any(|n| n == *late))
    {
        bail!("no {missing}.rs in {}", dir.display());
    }
    Ok(names)
}

/// A background job that ended: its name, seconds and outcome.
type Done = (String, f64, Result<()>);

/// One background job: `cargo xtask ARGS`.
struct Job {
    name: String,
    args: Vec<String>,
}

/// Jobs run one after the other as child `xtask` processes under `chrt --idle 0` (SCHED_IDLE:
/// they run only on a core nothing else wants, so the tests beside them keep the CPU they
/// ask for), their output in target/test-background.log.
struct Background {
    thread: Option<thread::JoinHandle<Vec<Done>>>,
    /// Told once the first `first` jobs ended (with whether they all passed).
    first: mpsc::Receiver<bool>,
    cancel: Arc<AtomicBool>,
    log: PathBuf,
}

impl Background {
    fn start(root: &Path, jobs: Vec<Job>, first: usize) -> Result<Self> {
        let exe = std::env::current_exe().context("the path of this xtask binary")?;
        let chrt = util::find_program("chrt").context("chrt not found: install util-linux")?;
        let log = util::target_dir(root).join("test-background.log");
        let file =
            fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let cancel = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let stop = Arc::clone(&cancel);
        let root = root.to_path_buf();
        eprintln!(
            "==> in the background (idle priority): {}; output in {}",
            jobs.iter()
                .map(|j| j.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            log.display()
        );
        forward_signals();
        let thread = thread::spawn(move || {
            let mut done = Vec::new();
            let mut all_ok = true;
            for (i, job) in jobs.into_iter().enumerate() {
                let start = Instant::now();
                let result = if stop.load(Ordering::Relaxed) {
                    Err(anyhow::anyhow!("not started: a step before it failed"))
                } else {
                    run_job(&chrt, &exe, &root, &job, &file, &stop)
                };
                all_ok &= result.is_ok();
                done.push((job.name, start.elapsed().as_secs_f64(), result));
                if i + 1 == first {
                    let _ = tx.send(all_ok);
                }
            }
            done
        });
        Ok(Self {
            thread: Some(thread),
            first: rx,
            cancel,
            log,
        })
    }

    /// Waits until the first jobs ended; fails if one failed.
    fn wait_first(&self, t: &Timings) -> Result<()> {
        match self.first.recv() {
            Ok(true) => Ok(()),
            Ok(false) | Err(_) => {
                t.note_log(&self.log);
                bail!("a background job failed (see {})", self.log.display())
            }
        }
    }

    /// Waits for every job (stopping them first if `abort`), records each, and fails if one
    /// failed.
    fn finish(mut self, t: &Timings, abort: bool) -> Result<()> {
        if abort {
            self.cancel.store(true, Ordering::Relaxed);
        }
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        let done = thread
            .join()
            .map_err(|_| anyhow::anyhow!("the background thread panicked"))?;
        let mut failed = Vec::new();
        for (name, seconds, result) in done {
            t.record(
                &format!("{name} (in the background)"),
                seconds,
                result.is_ok(),
            );
            if let Err(e) = result {
                failed.push(format!("{name}: {e:#}"));
            }
        }
        if failed.is_empty() || abort {
            return Ok(());
        }
        t.note_log(&self.log);
        bail!(
            "in the background: {} (see {})",
            failed.join("; "),
            self.log.display()
        )
    }
}

impl Drop for Background {
    /// Left without `finish` (an early error, a panic): the running job's group is killed and
    /// the thread joined, so no build or fuzzer outlives the test runner.
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        kill_group(JOB_GROUP.load(Ordering::SeqCst));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs one job to its end, or kills its process group once `stop` is set.
fn run_job(
    chrt: &Path,
    exe: &Path,
    root: &Path,
    job: &Job,
    log: &fs::File,
    stop: &AtomicBool,
) -> Result<()> {
    let mut cmd = Command::new(chrt);
    cmd.args(["--idle", "0"])
        .arg(exe)
        .args(&job.args)
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log.try_clone()?)
        // Its own process group: a stop ends its cargo and fuzzer too.
        .process_group(0);
    let line = util::display(&cmd);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot run `{line}`"))?;
    let group = libc::pid_t::try_from(child.id()).context("a pid beyond pid_t")?;
    JOB_GROUP.store(group, Ordering::SeqCst);
    let result = loop {
        match child.try_wait() {
            Ok(Some(status)) => break util::check(status, &line),
            Ok(None) => {}
            Err(e) => break Err(e).context("waiting for a background job"),
        }
        if stop.load(Ordering::Relaxed) {
            kill_group(group);
            let _ = child.wait();
            break Err(anyhow::anyhow!("stopped: a step beside it failed"));
        }
        thread::sleep(Duration::from_millis(200));
    };
    JOB_GROUP.store(0, Ordering::SeqCst);
    result
}

/// The process group of the background job running now (0: none), for [`on_signal`].
static JOB_GROUP: AtomicI32 = AtomicI32::new(0);

fn kill_group(group: libc::pid_t) {
    if group > 0 {
        // SAFETY: kill(2) with a negative pid signals that process group; no memory is shared.
        unsafe {
            libc::kill(-group, libc::SIGKILL);
        }
    }
}

/// A background job runs in a process group of its own, which the terminal's Ctrl-C does not
/// reach: SIGINT and SIGTERM kill its group first, then end this process as they would have.
fn forward_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `on_signal` only calls async-signal-safe functions (kill, signal, raise).
        unsafe {
            libc::signal(
                signal,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

extern "C" fn on_signal(signal: libc::c_int) {
    kill_group(JOB_GROUP.load(Ordering::SeqCst));
    // SAFETY: async-signal-safe; the default action ends the process as the signal would.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

/// Where the time went: every step, and inside the `cargo test` steps the build and each test
/// binary; plus the test counts of every binary.
struct Timings {
    start: Instant,
    rows: RefCell<Vec<Row>>,
    counts: RefCell<(u64, u64, u64)>,
}

struct Row {
    /// Steps at 0; a build or test binary inside a step at 1.
    depth: u8,
    name: String,
    seconds: f64,
    ok: bool,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            rows: RefCell::default(),
            counts: RefCell::default(),
        }
    }
}

impl Timings {
    /// Runs one step, announcing it, timing it and naming it if it fails.
    fn step(&self, name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        eprintln!("==> {name}");
        let start = Instant::now();
        // The step's own row goes before the rows its cargo test adds.
        let at = self.rows.borrow().len();
        let result = f().with_context(|| format!("step `{name}` failed"));
        let seconds = start.elapsed().as_secs_f64();
        eprintln!(
            "==> {name}: {} ({seconds:.1}s)",
            if result.is_ok() { "ok" } else { "FAILED" }
        );
        self.rows.borrow_mut().insert(
            at,
            Row {
                depth: 0,
                name: name.to_owned(),
                seconds,
                ok: result.is_ok(),
            },
        );
        result
    }

    fn record(&self, name: &str, seconds: f64, ok: bool) {
        self.rows.borrow_mut().push(Row {
            depth: 0,
            name: name.to_owned(),
            seconds,
            ok,
        });
    }

    /// Runs `cargo test ...`, passing its output through, counting its results and timing its
    /// build (until the first test binary runs) and each test binary.
    fn cargo_test(&self, cmd: &mut Command) -> Result<()> {
        let line = util::display(cmd);
        eprintln!("+ {line}");
        let start = Instant::now();
        let at = self.rows.borrow().len();
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run `{line}`"))?;
        // Cargo names each test binary on stderr as it starts it ("Running tests/x.rs (...)");
        // the binary's own result line, on stdout, says how long it ran.
        // In order: a name is taken by the next result line (the binaries run one at a time,
        // but cargo may name the next before this thread has read the last one's result).
        let running: Arc<Mutex<VecDeque<String>>> = Arc::default();
        let built: Arc<Mutex<Option<f64>>> = Arc::default();
        let stderr = child.stderr.take().map(|stderr| {
            let (running, built) = (Arc::clone(&running), Arc::clone(&built));
            thread::spawn(move || {
                for text in BufReader::new(stderr).lines().map_while(Result::ok) {
                    eprintln!("{text}");
                    if let Some(name) = running_binary(&text) {
                        let mut built = built.lock().unwrap_or_else(PoisonError::into_inner);
                        built.get_or_insert(start.elapsed().as_secs_f64());
                        running
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push_back(name);
                    }
                }
            })
        });
        if let Some(stdout) = child.stdout.take() {
            for text in BufReader::new(stdout).lines() {
                let text = text.context("reading test output")?;
                println!("{text}");
                let Some(result) = TestResult::parse(&text) else {
                    continue;
                };
                let mut counts = self.counts.borrow_mut();
                counts.0 += result.passed;
                counts.1 += result.failed;
                counts.2 += result.ignored;
                let name = running
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pop_front()
                    .unwrap_or_else(|| "(a test binary)".to_owned());
                self.rows.borrow_mut().push(Row {
                    depth: 1,
                    name: format!("{name}: {} tests", result.passed + result.failed),
                    seconds: result.seconds,
                    ok: result.failed == 0,
                });
            }
        }
        let status = child
            .wait()
            .with_context(|| format!("waiting for `{line}`"))?;
        if let Some(stderr) = stderr {
            let _ = stderr.join();
        }
        let built = *built.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(seconds) = built {
            // Before the binaries' rows: the build came first.
            self.rows.borrow_mut().insert(
                at,
                Row {
                    depth: 1,
                    name: "build".to_owned(),
                    seconds,
                    ok: true,
                },
            );
        }
        util::check(status, &line)
    }

    /// Prints the last lines of a background log, where a failure's reason is.
    fn note_log(&self, log: &Path) {
        let text = fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        eprintln!("--- the last lines of {}:", log.display());
        for line in &lines[lines.len().saturating_sub(40)..] {
            eprintln!("{line}");
        }
        eprintln!("---");
    }

    fn totals(&self) -> (u64, u64, u64) {
        *self.counts.borrow()
    }

    /// The table, as markdown (tests/README.md keeps one).
    fn table(&self) -> String {
        let mut out = String::from("\n| step | seconds |\n|---|---:|\n");
        for row in self.rows.borrow().iter() {
            let indent = if row.depth == 0 { "" } else { "&nbsp;&nbsp;" };
            let failed = if row.ok { "" } else { " **FAILED**" };
            let _ = writeln!(out, "| {indent}{}{failed} | {:.0} |", row.name, row.seconds);
        }
        let _ = writeln!(out, "| total | {:.0} |", self.start.elapsed().as_secs_f64());
        out
    }
}

/// `tests/agent.rs` from cargo's `     Running tests/agent.rs (target/debug/deps/agent-1f2e)`,
/// `unit tests src/lib.rs (wgfence)` from a unit test binary's line, `doc tests wgfence` from
/// `   Doc-tests wgfence`.
fn running_binary(line: &str) -> Option<String> {
    let line = line.trim_start();
    if let Some(krate) = line.strip_prefix("Doc-tests ") {
        return Some(format!("doc tests {}", krate.trim()));
    }
    let rest = line.strip_prefix("Running ")?;
    let (what, path) = rest.split_once(" (")?;
    let file = path.trim_end_matches(')').rsplit('/').next()?;
    // deps/<crate>-<hash>
    let krate = file.rsplit_once('-').map_or(file, |(name, _)| name);
    Some(match what.strip_prefix("unittests ") {
        Some(source) => format!("unit tests {source} ({krate})"),
        None => what.to_owned(),
    })
}

/// A line like `test result: ok. 34 passed; 0 failed; 2 ignored; ...; finished in 1.32s`.
#[derive(Debug, PartialEq)]
struct TestResult {
    passed: u64,
    failed: u64,
    ignored: u64,
    seconds: f64,
}

impl TestResult {
    fn parse(line: &str) -> Option<Self> {
        let rest = line.strip_prefix("test result: ")?;
        let mut result = TestResult {
            passed: 0,
            failed: 0,
            ignored: 0,
            seconds: 0.0,
        };
        for part in rest.split(';') {
            if let Some(time) = part.trim().strip_prefix("finished in ") {
                result.seconds = time.trim_end_matches('s').parse().unwrap_or(0.0);
                continue;
            }
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => result.passed = n,
                "failed" => result.failed = n,
                "ignored" => result.ignored = n,
                _ => {}
            }
        }
        Some(result)
    }
}

#[cfg(test)]
mod tests {
    use super::{running_binary, TestResult};

    #[test]
    fn reads_cargo_test_result_lines() {
        assert_eq!(
            TestResult::parse("test result: ok. 34 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1.32s"),
            Some(TestResult { passed: 34, failed: 0, ignored: 2, seconds: 1.32 })
        );
        assert_eq!(
            TestResult::parse(
                "test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out"
            )
            .map(|r| (r.passed, r.failed)),
            Some((3, 1))
        );
        assert_eq!(TestResult::parse("running 3 tests"), None);
    }

    #[test]
    fn names_the_running_test_binary() {
        assert_eq!(
            running_binary("     Running tests/agent.rs (target/debug/deps/agent-1f2e3d)")
                .as_deref(),
            Some("tests/agent.rs")
        );
        assert_eq!(
            running_binary("     Running unittests src/lib.rs (target/debug/deps/wgfence-5126)")
                .as_deref(),
            Some("unit tests src/lib.rs (wgfence)")
        );
        assert_eq!(
            running_binary("   Doc-tests wgfence_common").as_deref(),
            Some("doc tests wgfence_common")
        );
        assert_eq!(running_binary("   Compiling wgfence v0.1.0"), None);
    }
}
