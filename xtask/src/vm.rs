//! `cargo xtask vm-test`: boots Debian's kernels (5.10, 6.1, 6.12) under qemu (TCG) with a
//! busybox initramfs holding the release agent, and runs the conformance subset of
//! xtask/vm/conformance.sh inside each: kernel WireGuard in namespaces, enforcement, a policy
//! change, a timed revocation, SIGKILL and restart under a 10 ms ping, status, the drop monitor,
//! detach.
//!
//! Kernels come from Debian's archive through `apt-get download` with an apt configuration of
//! our own under target/vm/apt/ (its own sources file, lists and cache: the machine's apt
//! sources are read for the mirror only, never changed), unpacked with `dpkg-deb -x`, never
//! installed. Kernels and guest images are cached under target/vm/ between runs.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt::Write as _,
    fs,
    hash::{DefaultHasher, Hash, Hasher},
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{mpsc, Mutex, PoisonError},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use crate::{build, setup, util};

/// Host packages the VM needs: qemu (from the machine's plain suite), the guest's shell and
/// tools, the image's archiver, depmod.
pub const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "kmod",
    "xz-utils",
    "zstd",
    "iproute2",
    "iputils-ping",
    "wireguard-tools",
    "coreutils",
    "bpftool",
    "llvm",
];

const INIT: &str = include_str!("../vm/init.sh");
const CONFORMANCE: &str = include_str!("../vm/conformance.sh");
/// The empty program the per-packet cost is a ratio to (LLVM IR; `llc` builds it).
const EMPTY_PROGRAM: &str = include_str!("../vm/empty.ll");

/// Kernel modules the guest loads (with their dependencies): kernel WireGuard, the underlay,
/// the destinations, and the legacy TC hook (clsact qdisc, cls_bpf).
const MODULES: &[&str] = &["wireguard", "veth", "dummy", "sch_ingress", "cls_bpf"];

/// The guest CPU. Debian 12's qemu 7.2 under TCG corrupts the guest kernel now and then with
/// `-cpu max` (seen here: general protection faults and double faults in SLUB's
/// `cmpxchg16b`-based fast path, 1 boot in 5); without CX16 the kernel takes its locked
/// path and no boot crashed.
const CPU: &str = "max,-cx16";

/// Host programs copied into the guest with their shared libraries.
const GUEST_PROGRAMS: &[&str] = &["ip", "tc", "wg", "ping", "date", "bpftool"];

/// The checks of conformance.sh, in the table's column order, with their headers.
const CHECKS: &[(&str, &str)] = &[
    ("start", "agent start"),
    ("wg_add", "WG add"),
    ("enforce_v4", "enforce IPv4"),
    ("enforce_v6", "enforce IPv6"),
    ("policy_change", "policy change"),
    ("wg_update", "WG update"),
    ("restart", "SIGKILL+restart, 10 ms ping"),
    ("wg_adopt", "WG adopt"),
    ("status", "status"),
    ("monitor", "monitor"),
    ("revocation", "revocation"),
    ("detach", "detach"),
    ("differential", "differential (BPF_PROG_TEST_RUN)"),
    ("cost", "per-packet cost, ratio to an empty program"),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum Kernel {
    #[value(name = "5.10")]
    V5_10,
    #[value(name = "6.1")]
    V6_1,
    #[value(name = "6.12")]
    V6_12,
}

impl Kernel {
    fn series(self) -> &'static str {
        match self {
            Kernel::V5_10 => "5.10",
            Kernel::V6_1 => "6.1",
            Kernel::V6_12 => "6.12",
        }
    }

    /// The Debian suite that ships it.
    fn suite(self) -> &'static str {
        match self {
            Kernel::V5_10 => "bullseye",
            Kernel::V6_1 => "bookworm",
            Kernel::V6_12 => "bookworm-backports",
        }
    }

    /// Package names are `PREFIX<version>-cloud-amd64-unsigned`.
    fn package_prefix(self) -> &'static str {
        match self {
            Kernel::V5_10 => "linux-image-5.10.0-",
            Kernel::V6_1 => "linux-image-6.1.0-",
            Kernel::V6_12 => "linux-image-6.12.",
        }
    }
}

/// One guest: a kernel, and the hook its agent is told to use (`auto` unless named).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum Guest {
    #[value(name = "5.10")]
    V5_10,
    #[value(name = "6.1")]
    V6_1,
    #[value(name = "6.12")]
    V6_12,
    /// 6.12 with `--attach tc`: the legacy hook on a kernel that has tcx.
    #[value(name = "6.12-tc")]
    V6_12Tc,
}

impl Guest {
    const ALL: [Guest; 4] = [Guest::V5_10, Guest::V6_1, Guest::V6_12, Guest::V6_12Tc];

    fn kernel(self) -> Kernel {
        match self {
            Guest::V5_10 => Kernel::V5_10,
            Guest::V6_1 => Kernel::V6_1,
            Guest::V6_12 | Guest::V6_12Tc => Kernel::V6_12,
        }
    }

    fn attach(self) -> Option<&'static str> {
        match self {
            Guest::V6_12Tc => Some("tc"),
            Guest::V5_10 | Guest::V6_1 | Guest::V6_12 => None,
        }
    }

    fn name(self) -> String {
        guest_name(self.kernel(), self.attach())
    }
}

/// Seconds one guest may run (a passing run takes 5 to 7 minutes under TCG on two shared
/// cores, most of it the differential test).
const DEFAULT_TIMEOUT: u64 = 900;

const PACKAGE_SUFFIX: &str = "-cloud-amd64-unsigned";

#[derive(Args, Clone)]
pub struct Options {
    /// Only this kernel's guests (repeat for several; 6.12 boots twice: tcx, then `--attach
    /// tc`); default: every guest.
    #[arg(long = "kernel", value_enum)]
    pub kernels: Vec<Kernel>,
    /// Only this guest (repeat for several): 5.10, 6.1, 6.12, or 6.12-tc.
    #[arg(long = "guest", value_enum)]
    pub guests: Vec<Guest>,
    /// Guests booted at once (each has one virtual CPU); default: the host's CPUs.
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Seconds one guest may run before it is killed and counted as failed.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT)]
    pub timeout: u64,
    /// Look the kernels up in the archive again instead of using the cached ones.
    #[arg(long)]
    pub refresh: bool,
    /// Run this agent binary instead of building the release agent (e.g. another branch's).
    #[arg(long, value_name = "PATH")]
    pub agent: Option<PathBuf>,
    /// Rounds of the differential test in each guest (generated states, each loaded anew);
    /// default: the test's 12.
    #[arg(long, value_name = "N")]
    pub diff_rounds: Option<u64>,
}

impl Options {
    /// Every guest, the default timeout, the agent built from this tree.
    pub fn all() -> Self {
        Self {
            kernels: Vec::new(),
            guests: Vec::new(),
            jobs: None,
            timeout: DEFAULT_TIMEOUT,
            refresh: false,
            agent: None,
            diff_rounds: None,
        }
    }

    /// The guests `cargo xtask test` boots: 6.1 (no tcx: the legacy TC hook, as on every
    /// kernel before 6.6) and 6.12 (tcx), running `agent` (the debug agent the integration
    /// tests ran, so the suite builds the agent once). `--full` boots every guest with the
    /// release agent.
    /// The differential test runs 4 of its 12 rounds in each guest: a round's program and
    /// probe loads cost most of its time under emulation, and the 12,000 packets still reach
    /// every verdict (the test asserts it).
    pub fn ci(agent: PathBuf) -> Self {
        Self {
            guests: vec![Guest::V6_1, Guest::V6_12],
            agent: Some(agent),
            diff_rounds: Some(4),
            ..Self::all()
        }
    }

    /// The guests to boot, in order.
    fn selected(&self) -> Vec<Guest> {
        let every = self.guests.is_empty() && self.kernels.is_empty();
        Guest::ALL
            .into_iter()
            .filter(|guest| {
                every || self.guests.contains(guest) || self.kernels.contains(&guest.kernel())
            })
            .collect()
    }

    /// The kernels those guests need.
    fn selected_kernels(&self) -> Vec<Kernel> {
        let mut kernels: Vec<Kernel> = self.selected().iter().map(|g| g.kernel()).collect();
        kernels.dedup();
        kernels
    }

    /// The names of the guests to boot: `6.1`, `6.12-tc`.
    pub fn guest_names(&self) -> Vec<String> {
        self.selected().into_iter().map(Guest::name).collect()
    }
}

/// One guest's outcome, parsed from its console.
#[derive(Debug, Default)]
struct Report {
    /// The guest: kernel series and forced hook (`6.12-tc`).
    name: String,
    /// `--attach` as the agent was given it (`auto`: its default).
    attach: String,
    release: String,
    hook: String,
    backend: String,
    boot_seconds: Option<f64>,
    wall_seconds: f64,
    /// check -> (passed, ms, detail)
    checks: BTreeMap<String, (bool, u64, String)>,
    passed: bool,
    log: PathBuf,
}

/// Installs the host packages and fetches the selected guests' kernels (cached): what
/// `cargo xtask test` does in the background while it builds and tests.
pub fn prefetch(options: &Options) -> Result<()> {
    setup::ensure_packages(PACKAGES).context("vm-test: host packages")?;
    let work = util::target_dir(&util::workspace_root()?).join("vm");
    for kernel in options.selected_kernels() {
        fetch_kernel(&work, kernel, options.refresh)
            .with_context(|| format!("fetching the {} kernel", kernel.series()))?;
    }
    Ok(())
}

pub fn run(options: Options) -> Result<()> {
    let agent = match &options.agent {
        Some(agent) => agent.clone(),
        // Sets up what building needs, then builds the release agent the guests run.
        None => build::build(false)?.agent,
    };
    setup::ensure_packages(PACKAGES).context("vm-test: host packages")?;
    let differential = build_differential().context("building the differential test")?;
    let root = util::workspace_root()?;
    let work = util::target_dir(&root).join("vm");

    let mut images = BTreeMap::new();
    for kernel in options.selected_kernels() {
        let unpacked = fetch_kernel(&work, kernel, options.refresh)
            .with_context(|| format!("fetching the {} kernel", kernel.series()))?;
        let image = build_image(&work, kernel, &unpacked, &agent, &differential)
            .with_context(|| format!("building the {} guest image", kernel.series()))?;
        images.insert(kernel, (unpacked, image));
    }
    let guests = options.selected();
    let jobs = options
        .jobs
        .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, guests.len().max(1));
    // Each guest has one virtual CPU, and TCG runs it on one host thread: `jobs` guests side
    // by side, each taking the next guest from the queue.
    let queue = Mutex::new(guests.iter().copied().enumerate());
    let results = Mutex::new(Vec::new());
    thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                let Some((at, guest)) = next else { break };
                let name = guest.name();
                let result = match images.get(&guest.kernel()) {
                    Some((unpacked, image)) => {
                        eprintln!("==> vm-test {name}");
                        boot(&work, guest, unpacked, image, &options)
                            .with_context(|| format!("booting {name}"))
                    }
                    None => Err(anyhow::anyhow!("no image was built for {name}")),
                };
                if let Ok(report) = &result {
                    eprintln!(
                        "==> vm-test {name}: {} in {:.1}s (console: {})",
                        if report.passed { "PASS" } else { "FAIL" },
                        report.wall_seconds,
                        report.log.display()
                    );
                }
                results
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((at, result));
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(PoisonError::into_inner);
    results.sort_by_key(|(at, _)| *at);
    let mut reports = Vec::new();
    for (_, result) in results {
        reports.push(result?);
    }
    let table = table(&reports);
    println!("{table}");
    let out = work.join("results.md");
    fs::write(&out, &table).with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!("vm-test: table written to {}", out.display());
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| !r.passed)
        .map(|r| r.name.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("vm-test failed on {}", failed.join(", "));
    }
    Ok(())
}

/// A kernel unpacked under target/vm/kernel-SERIES/: its vmlinuz and its modules.
struct Unpacked {
    package: String,
    release: String,
    vmlinuz: PathBuf,
    modules: PathBuf,
}

fn fetch_kernel(work: &Path, kernel: Kernel, refresh: bool) -> Result<Unpacked> {
    let dir = work.join(format!("kernel-{}", kernel.series()));
    let stamp = dir.join("package");
    if !refresh {
        if let Ok(package) = fs::read_to_string(&stamp) {
            if let Ok(unpacked) = unpacked(&dir, package.trim()) {
                eprintln!("ok: cached {}", unpacked.package);
                return Ok(unpacked);
            }
        }
    }
    let apt = Apt::new(work)?;
    let package = apt.newest(kernel)?;
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    let download = dir.join("deb");
    fs::create_dir_all(&download)
        .with_context(|| format!("cannot create {}", download.display()))?;
    let mut cmd = apt.command("apt-get");
    cmd.current_dir(&download).args(["download", &package]);
    util::run(&mut cmd)?;
    let deb = fs::read_dir(&download)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|ext| ext == "deb"))
        .with_context(|| format!("apt-get download left no .deb in {}", download.display()))?;
    util::run(
        Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(dir.join("root")),
    )?;
    fs::remove_dir_all(&download).ok();
    let unpacked = unpacked(&dir, &package)?;
    // The package ships no modules.dep (installing it would run depmod): make it here.
    depmod(&dir.join("root"), &unpacked.release)?;
    fs::write(&stamp, &package)?;
    Ok(unpacked)
}

fn unpacked(dir: &Path, package: &str) -> Result<Unpacked> {
    let modules_root = dir.join("root/lib/modules");
    let release = fs::read_dir(&modules_root)
        .with_context(|| format!("cannot read {}", modules_root.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .with_context(|| format!("no kernel release under {}", modules_root.display()))?;
    let vmlinuz = dir.join("root/boot").join(format!("vmlinuz-{release}"));
    if !vmlinuz.is_file() {
        bail!("{} is missing", vmlinuz.display());
    }
    Ok(Unpacked {
        package: package.to_owned(),
        modules: modules_root.join(&release),
        release,
        vmlinuz,
    })
}

/// apt with a configuration of its own: our sources file, lists and cache under target/vm/apt/.
struct Apt {
    options: Vec<String>,
}

impl Apt {
    fn new(work: &Path) -> Result<Self> {
        let dir = work.join("apt");
        let lists = dir.join("lists");
        let cache = dir.join("cache");
        for d in [lists.join("partial"), cache.join("archives/partial")] {
            fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
        }
        let mirror = debian_mirror()?;
        let sources = dir.join("sources.list");
        let text = sources_list(&mirror);
        // Idempotent: written only when it changes, so a second run changes nothing here.
        if fs::read_to_string(&sources).ok().as_deref() != Some(text.as_str()) {
            fs::write(&sources, &text)
                .with_context(|| format!("cannot write {}", sources.display()))?;
        }
        let options = [
            format!("Dir::Etc::SourceList={}", sources.display()),
            format!("Dir::Etc::SourceParts={}", dir.join("parts.d").display()),
            format!("Dir::State::Lists={}", lists.display()),
            format!("Dir::Cache={}", cache.display()),
            "Dir::State::status=/dev/null".to_owned(),
            "Debug::NoLocking=1".to_owned(),
            "APT::Sandbox::User=root".to_owned(),
        ]
        .into_iter()
        .flat_map(|o| ["-o".to_owned(), o])
        .collect();
        let apt = Self { options };
        util::run(apt.command("apt-get").arg("update").arg("-qq"))?;
        Ok(apt)
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.args(&self.options);
        cmd
    }

    /// The newest cloud kernel package of `kernel`'s series in its suite.
    fn newest(&self, kernel: Kernel) -> Result<String> {
        let pattern = format!(
            "^{}.*{}$",
            kernel.package_prefix().replace('.', "\\."),
            PACKAGE_SUFFIX
        );
        let out = util::query(
            self.command("apt-cache")
                .args(["search", "--names-only"])
                .arg(&pattern),
        )
        .with_context(|| format!("apt-cache search {pattern} failed"))?;
        newest_package(&out, kernel).with_context(|| {
            format!(
                "no {}*{PACKAGE_SUFFIX} in {}",
                kernel.package_prefix(),
                kernel.suite()
            )
        })
    }
}

fn sources_list(mirror: &str) -> String {
    let mut text = String::from(
        "# Written by `cargo xtask vm-test`: the suites its kernels come from (download only).\n",
    );
    for suite in ["bookworm", "bookworm-backports", "bullseye"] {
        let _ = writeln!(
            text,
            "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror} {suite} main"
        );
    }
    text
}

/// The Debian mirror this machine's apt already uses for its main suite (not the security
/// archive), read from /etc/apt/sources.list.d/*.sources, *.list and /etc/apt/sources.list.
fn debian_mirror() -> Result<String> {
    let mut texts = Vec::new();
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let name = path.to_string_lossy().into_owned();
            if name.ends_with(".sources") || name.ends_with(".list") {
                if let Ok(text) = fs::read_to_string(&path) {
                    texts.push(text);
                }
            }
        }
    }
    if let Ok(text) = fs::read_to_string("/etc/apt/sources.list") {
        texts.push(text);
    }
    texts
        .iter()
        .find_map(|text| mirror_in(text))
        .context("no Debian mirror for bookworm in /etc/apt/sources.list(.d): vm-test reuses it")
}

/// The URI of the first source serving a plain Debian suite (deb822 or one-line format).
fn mirror_in(text: &str) -> Option<String> {
    let debian_suite =
        |suite: &str| ["bookworm", "bullseye", "trixie"].contains(&suite) && !suite.is_empty();
    // One-line: `deb [opts] URI SUITE COMPONENTS...`
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let rest = rest.trim_start();
        let rest = match rest.strip_prefix('[') {
            Some(r) => r.split_once(']').map_or("", |(_, after)| after),
            None => rest,
        };
        let mut words = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            if debian_suite(suite) {
                return Some(uri.trim_end_matches('/').to_owned());
            }
        }
    }
    // deb822: paragraphs with `URIs:` and `Suites:`.
    for paragraph in text.split("\n\n") {
        let field = |name: &str| {
            paragraph.lines().find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|r| r.strip_prefix(':'))
                    .map(str::trim)
            })
        };
        let (Some(uris), Some(suites)) = (field("URIs"), field("Suites")) else {
            continue;
        };
        if suites.split_whitespace().any(debian_suite) {
            if let Some(uri) = uris.split_whitespace().next() {
                return Some(uri.trim_end_matches('/').to_owned());
            }
        }
    }
    None
}

/// The newest package of `apt-cache search` output with `kernel`'s prefix and the suffix.
fn newest_package(search: &str, kernel: Kernel) -> Option<String> {
    search
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| {
            name.strip_prefix(kernel.package_prefix())
                .is_some_and(|rest| rest.ends_with(PACKAGE_SUFFIX))
        })
        .max_by_key(|name| version_key(name))
        .map(str::to_owned)
}

/// The numbers in a package name, in order: `6.12.90+deb12.1` sorts after `6.12.90+deb12`.
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// Builds (or reuses) target/vm/image-SERIES.cpio, an uncompressed initramfs.
fn build_image(
    work: &Path,
    kernel: Kernel,
    unpacked: &Unpacked,
    agent: &Path,
    differential: &Path,
) -> Result<PathBuf> {
    let image = work.join(format!("image-{}.cpio", kernel.series()));
    let key_file = work.join(format!("image-{}.key", kernel.series()));
    let key = image_key(unpacked, &[agent, differential])?;
    if image.is_file() && fs::read_to_string(&key_file).ok().as_deref() == Some(key.as_str()) {
        eprintln!("ok: cached guest image {}", image.display());
        return Ok(image);
    }
    let root = work.join(format!("root-{}", kernel.series()));
    if root.exists() {
        fs::remove_dir_all(&root).with_context(|| format!("cannot remove {}", root.display()))?;
    }
    for dir in [
        "bin", "sbin", "usr/bin", "usr/sbin", "lib", "lib64", "proc", "sys", "dev", "tmp", "run",
        "etc", "root",
    ] {
        fs::create_dir_all(root.join(dir))?;
    }
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .context("no busybox: install busybox-static")?;
    copy(busybox, &root.join("bin/busybox"))?;
    write_executable(&root.join("init"), INIT)?;
    write_executable(&root.join("conformance.sh"), CONFORMANCE)?;
    let empty = root.join("empty.ll");
    fs::write(&empty, EMPTY_PROGRAM)?;
    util::run(
        Command::new(util::find_program("llc").context("llc not found: install llvm")?)
            .args(["-march=bpfel", "-filetype=obj", "-o"])
            .arg(root.join("empty.o"))
            .arg(&empty),
    )?;

    let mut libraries = BTreeSet::new();
    for name in GUEST_PROGRAMS {
        let path = util::find_program(name).with_context(|| format!("{name} not found"))?;
        copy(&path, &root.join("usr/bin").join(name))?;
        libraries.extend(shared_libraries(&path)?);
    }
    // Our binaries without their debug information (the debug agent and the test binary:
    // about a tenth of their size): the image stays small.
    for (binary, name) in [(agent, "wgfence"), (differential, "differential")] {
        util::run(
            Command::new("objcopy")
                .arg("--strip-debug")
                .arg(binary)
                .arg(root.join("usr/bin").join(name)),
        )?;
        libraries.extend(shared_libraries(binary)?);
    }
    for lib in &libraries {
        let relative = lib.strip_prefix("/").unwrap_or(lib);
        copy(lib, &root.join(relative))?;
    }
    copy_modules(unpacked, &root)?;
    fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")?;

    // An uncompressed newc archive: qemu loads it as it is, and packing stays quick.
    let file =
        fs::File::create(&image).with_context(|| format!("cannot create {}", image.display()))?;
    let mut find = Command::new("find")
        .args([".", "-print0"])
        .current_dir(&root)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot run find")?;
    let names = find.stdout.take().context("find has no stdout")?;
    let status = Command::new("cpio")
        .args(["--null", "-o", "-H", "newc", "-R", "0:0", "--quiet"])
        .current_dir(&root)
        .stdin(names)
        .stdout(file)
        .status()
        .context("cannot run cpio")?;
    util::check(find.wait()?, "find")?;
    util::check(status, "cpio -o -H newc")?;
    fs::write(&key_file, key)?;
    eprintln!(
        "ok: guest image {} ({} MB)",
        image.display(),
        fs::metadata(&image)?.len() >> 20
    );
    Ok(image)
}

/// What the image depends on: the kernel, the binaries, the scripts.
fn image_key(unpacked: &Unpacked, binaries: &[&Path]) -> Result<String> {
    let mut hasher = DefaultHasher::new();
    (INIT, CONFORMANCE, EMPTY_PROGRAM, MODULES, GUEST_PROGRAMS).hash(&mut hasher);
    for binary in binaries {
        let meta = fs::metadata(binary).with_context(|| format!("{}", binary.display()))?;
        binary.hash(&mut hasher);
        meta.len().hash(&mut hasher);
        meta.modified().ok().hash(&mut hasher);
    }
    Ok(format!("{} {:016x}\n", unpacked.package, hasher.finish()))
}

/// Builds the differential test (tests/tests/differential.rs) and returns its executable, which
/// the guest runs against the datapath as that kernel's verifier loads it.
fn build_differential() -> Result<PathBuf> {
    let root = util::workspace_root()?;
    let mut cmd = util::cargo_command(&root);
    cmd.args([
        "test",
        "--package",
        "wgfence-tests",
        "--test",
        "differential",
    ])
    .args(["--no-run", "--message-format=json"])
    .stderr(Stdio::inherit());
    eprintln!("+ {}", util::display(&cmd));
    let out = cmd.output().context("cannot run cargo test --no-run")?;
    util::check(out.status, "cargo test --no-run")?;
    let text = String::from_utf8_lossy(&out.stdout);
    executable_of(&text, "differential")
        .map(PathBuf::from)
        .context("cargo reported no executable for the differential test")
}

/// The `"executable"` of the compiler-artifact message for test target `name`.
fn executable_of(messages: &str, name: &str) -> Option<String> {
    messages
        .lines()
        .filter(|l| l.contains(&format!("\"name\":\"{name}\"")))
        .find_map(|l| {
            let (_, rest) = l.split_once("\"executable\":\"")?;
            rest.split_once('"').map(|(path, _)| path.to_owned())
        })
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    if let Some(parent) = to.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::copy(from, to)
        .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn write_executable(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The shared libraries `ldd` lists for a program (with the dynamic loader); none if static.
fn shared_libraries(program: &Path) -> Result<Vec<PathBuf>> {
    let Some(out) = util::query(Command::new("ldd").arg(program)) else {
        // ldd fails on a static binary ("not a dynamic executable").
        return Ok(Vec::new());
    };
    Ok(parse_ldd(&out))
}

fn parse_ldd(out: &str) -> Vec<PathBuf> {
    out.lines()
        .filter_map(|line| {
            let line = line.trim();
            let path = match line.split_once("=>") {
                Some((_, after)) => after.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// Copies [`MODULES`] and their dependencies (from modules.dep), decompressed, then `depmod`.
fn copy_modules(unpacked: &Unpacked, root: &Path) -> Result<()> {
    let dep_file = unpacked.modules.join("modules.dep");
    let deps = fs::read_to_string(&dep_file)
        .with_context(|| format!("cannot read {}", dep_file.display()))?;
    let graph = parse_modules_dep(&deps);
    let mut wanted: Vec<String> = Vec::new();
    for module in MODULES {
        match graph.keys().find(|path| module_name(path) == *module) {
            Some(path) => wanted.push(path.clone()),
            // Built into this kernel (listed in modules.builtin): nothing to copy.
            None => eprintln!("note: module {module} is built into {}", unpacked.release),
        }
    }
    let mut seen = HashSet::new();
    while let Some(path) = wanted.pop() {
        if !seen.insert(path.clone()) {
            continue;
        }
        if let Some(deps) = graph.get(&path) {
            wanted.extend(deps.iter().cloned());
        }
    }
    let target = root.join("lib/modules").join(&unpacked.release);
    for path in &seen {
        let from = unpacked.modules.join(path);
        let to = target.join(path);
        copy(&from, &to)?;
        let decompressor = match to.extension().and_then(|e| e.to_str()) {
            Some("xz") => Some("xz"),
            Some("zst") => Some("zstd"),
            _ => None,
        };
        if let Some(tool) = decompressor {
            util::run(Command::new(tool).args(["-d", "-q", "-f"]).arg(&to))?;
        }
    }
    for file in [
        "modules.order",
        "modules.builtin",
        "modules.builtin.modinfo",
    ] {
        let from = unpacked.modules.join(file);
        if from.is_file() {
            copy(&from, &target.join(file))?;
        }
    }
    depmod(root, &unpacked.release)
}

/// `depmod -b ROOT RELEASE`: writes ROOT/lib/modules/RELEASE/modules.dep and friends.
fn depmod(root: &Path, release: &str) -> Result<()> {
    util::run(
        Command::new(util::find_program("depmod").context("depmod not found: install kmod")?)
            .arg("-b")
            .arg(root)
            .arg(release),
    )
}

/// modules.dep: `kernel/a.ko.xz: kernel/b.ko.xz kernel/c.ko.xz`.
fn parse_modules_dep(text: &str) -> BTreeMap<String, Vec<String>> {
    text.lines()
        .filter_map(|line| {
            let (module, deps) = line.split_once(':')?;
            Some((
                module.trim().to_owned(),
                deps.split_whitespace().map(str::to_owned).collect(),
            ))
        })
        .collect()
}

/// `kernel/drivers/net/wireguard/wireguard.ko.xz` -> `wireguard`.
fn module_name(path: &str) -> &str {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split_once(".ko").map_or(file, |(name, _)| name)
}

/// Kills the guest when dropped: no qemu outlives the host side, whatever way it ends.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// `6.12`, or `6.12-tc` for a guest told `--attach tc`.
fn guest_name(kernel: Kernel, attach: Option<&str>) -> String {
    match attach {
        Some(attach) => format!("{}-{attach}", kernel.series()),
        None => kernel.series().to_owned(),
    }
}

fn boot(
    work: &Path,
    guest: Guest,
    unpacked: &Unpacked,
    image: &Path,
    options: &Options,
) -> Result<Report> {
    let (attach, timeout) = (guest.attach(), options.timeout);
    let name = guest.name();
    let log_path = work.join(format!("console-{name}.log"));
    let mut append = String::from("console=ttyS0 quiet panic=-1 rdinit=/init");
    if let Some(attach) = attach {
        // Read by conformance.sh, which passes it to `wgfence run --attach`.
        let _ = write!(append, " wgfence.attach={attach}");
    }
    if let Some(rounds) = options.diff_rounds {
        let _ = write!(append, " wgfence.diff_rounds={rounds}");
    }
    let mut log = fs::File::create(&log_path)
        .with_context(|| format!("cannot create {}", log_path.display()))?;
    let qemu = util::find_program("qemu-system-x86_64")
        .context("qemu-system-x86_64 not found: install qemu-system-x86")?;
    // setpriv --pdeathsig: the kernel kills qemu if this process dies (Ctrl-C, SIGKILL), which
    // the Drop of `Guest` cannot cover.
    let mut cmd = Command::new("setpriv");
    cmd.args(["--pdeathsig", "KILL", "--"])
        .arg(qemu)
        .args(["-accel", "tcg", "-cpu", CPU, "-smp", "1", "-m", "1024"])
        .args(["-nographic", "-no-reboot"])
        .arg("-kernel")
        .arg(&unpacked.vmlinuz)
        .arg("-initrd")
        .arg(image)
        .arg("-append")
        .arg(&append)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!("+ {}", util::display(&cmd));
    let start = Instant::now();
    let mut child = cmd.spawn().context("cannot start qemu")?;
    let stdout = child.stdout.take().context("qemu has no stdout")?;
    let stderr = child.stderr.take().context("qemu has no stderr")?;
    let mut qemu = Qemu(child);
    let (tx, rx) = mpsc::channel::<String>();
    let tx2 = tx.clone();
    let readers = [
        thread::spawn(move || forward(stdout, &tx)),
        thread::spawn(move || forward(stderr, &tx2)),
    ];

    let deadline = start + Duration::from_secs(timeout);
    let mut report = Report {
        name: name.clone(),
        attach: attach.unwrap_or("auto").to_owned(),
        release: unpacked.release.clone(),
        log: log_path.clone(),
        ..Report::default()
    };
    let mut timed_out = false;
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                let _ = writeln!(log, "{line}");
                // The console may prefix a line with terminal escapes.
                if let Some(at) = line.find("VMTEST") {
                    eprintln!("  [{name}] {}", &line[at..]);
                    report.parse(&line[at..]);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if Instant::now() > deadline {
            timed_out = true;
            break;
        }
    }
    if timed_out {
        eprintln!("vm-test {name}: no verdict within {timeout}s, killing qemu");
        let _ = qemu.0.kill();
    }
    let status = qemu.0.wait().context("waiting for qemu")?;
    for reader in readers {
        let _ = reader.join();
    }
    while let Ok(line) = rx.try_recv() {
        let _ = writeln!(log, "{line}");
        if let Some(at) = line.find("VMTEST") {
            report.parse(&line[at..]);
        }
    }
    report.wall_seconds = start.elapsed().as_secs_f64();
    if timed_out || !status.success() {
        report.passed = false;
    }
    Ok(report)
}

/// Sends each line of `pipe` (console lines end in CR LF) until it closes.
fn forward(pipe: impl std::io::Read, tx: &mpsc::Sender<String>) {
    for line in BufReader::new(pipe).split(b'\n') {
        let Ok(line) = line else { break };
        let text = String::from_utf8_lossy(&line).trim_end().to_owned();
        if tx.send(text).is_err() {
            break;
        }
    }
}

impl Report {
    /// One `VMTEST ...` console line.
    fn parse(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("VMTEST ") else {
            return;
        };
        let fields: BTreeMap<&str, &str> = rest
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .collect();
        if let Some(result) = rest.strip_prefix("RESULT ") {
            self.passed = result.trim() == "PASS";
        } else if rest.starts_with("info ") {
            self.release = fields.get("kernel").unwrap_or(&"").to_string();
            self.backend = fields.get("backend").unwrap_or(&"").to_string();
            // Last on the line, and may hold spaces: `tc (clsact)`.
            self.hook = rest
                .split_once(" hook=")
                .map_or("", |(_, h)| h.trim())
                .to_owned();
        } else if rest.starts_with("boot ") {
            self.boot_seconds = fields.get("uptime").and_then(|s| s.parse().ok());
        } else if let (Some(check), Some(result)) = (fields.get("check"), fields.get("result")) {
            let ms = fields.get("ms").and_then(|s| s.parse().ok()).unwrap_or(0);
            // Free text, spaces included, to the end of the line.
            let detail = rest
                .split_once(" detail=")
                .map_or("", |(_, d)| d.trim())
                .to_owned();
            self.checks
                .insert((*check).to_owned(), (*result == "pass", ms, detail));
        }
    }
}

/// The markdown table of docs/operations.md ("Supported kernels").
fn table(reports: &[Report]) -> String {
    let mut out = String::from("| kernel | `--attach` | hook | WireGuard | boot | wall |");
    for (_, header) in CHECKS {
        let _ = write!(out, " {header} |");
    }
    out.push_str("\n|---|---|---|---|---|---|");
    for _ in CHECKS {
        out.push_str("---|");
    }
    out.push('\n');
    for r in reports {
        let _ = write!(
            out,
            "| {} | {} | {} | {} | {} | {:.0} s |",
            r.release,
            r.attach,
            or_dash(&r.hook),
            or_dash(&r.backend),
            r.boot_seconds
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.1} s")),
            r.wall_seconds
        );
        for (check, _) in CHECKS {
            let cell = match r.checks.get(*check) {
                // The cost's figures are its detail.
                Some((true, _, detail)) if *check == "cost" => detail.clone(),
                Some((true, ms, _)) if *ms > 0 => format!("pass, {ms} ms"),
                Some((true, _, _)) => "pass".to_owned(),
                Some((false, _, detail)) if !detail.is_empty() => {
                    format!("**FAIL** ({})", detail.replace('|', "/"))
                }
                Some((false, _, _)) => "**FAIL**".to_owned(),
                None => "not run".to_owned(),
            };
            let _ = write!(out, " {cell} |");
        }
        out.push('\n');
    }
    out
}

fn or_dash(s: &str) -> &str {
    if s.is_empty() {
        "-"
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_mirror_in_both_source_formats() {
        let deb822 = "Types: deb\nURIs: http://mirror.example/debian-security\n\
                      Suites: bookworm-security\nComponents: main\n\n\
                      Types: deb\nURIs: http://mirror.example/debian/\n\
                      Suites: bookworm bookworm-updates\nComponents: main\n";
        assert_eq!(
            mirror_in(deb822).as_deref(),
            Some("http://mirror.example/debian")
        );
        let one_line = "deb [arch=amd64] http://m.example/debian bookworm main\n";
        assert_eq!(
            mirror_in(one_line).as_deref(),
            Some("http://m.example/debian")
        );
        assert_eq!(mirror_in("deb http://x.example/apt cloud-sdk main\n"), None);
    }

    #[test]
    fn picks_the_newest_kernel_of_the_series() {
        let search = "linux-image-6.1.0-47-cloud-amd64-unsigned - Linux 6.1\n\
                      linux-image-6.1.0-50-cloud-amd64-unsigned - Linux 6.1\n\
                      linux-image-6.1.0-50-cloud-amd64 - signed\n\
                      linux-image-6.12.95+deb12-cloud-amd64-unsigned - Linux 6.12\n";
        assert_eq!(
            newest_package(search, Kernel::V6_1).as_deref(),
            Some("linux-image-6.1.0-50-cloud-amd64-unsigned")
        );
        assert_eq!(
            newest_package(search, Kernel::V6_12).as_deref(),
            Some("linux-image-6.12.95+deb12-cloud-amd64-unsigned")
        );
        assert_eq!(newest_package(search, Kernel::V5_10), None);
    }

    #[test]
    fn reads_modules_dep_and_ldd() {
        let graph = parse_modules_dep(
            "kernel/drivers/net/wireguard/wireguard.ko.xz: kernel/net/ipv4/udp_tunnel.ko.xz\n",
        );
        let (path, deps) = graph.iter().next().map(|(p, d)| (p.as_str(), d)).unzip();
        assert_eq!(path.map(module_name), Some("wireguard"));
        assert_eq!(deps.map(Vec::len), Some(1));
        let ldd = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f41)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f41)\n";
        assert_eq!(
            parse_ldd(ldd),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
    }

    #[test]
    fn finds_the_test_executable_in_cargo_messages() {
        let messages = r#"{"reason":"compiler-artifact","target":{"name":"wgfence_tests"},"executable":null}
{"reason":"compiler-artifact","target":{"kind":["test"],"name":"differential"},"profile":{},"executable":"/w/target/debug/deps/differential-5d8e"}
"#;
        assert_eq!(
            executable_of(messages, "differential").as_deref(),
            Some("/w/target/debug/deps/differential-5d8e")
        );
        assert_eq!(executable_of(messages, "faults"), None);
    }

    #[test]
    fn parses_the_guest_lines() {
        let mut r = Report::default();
        r.parse("VMTEST info kernel=6.12.95+deb12-cloud-amd64 backend=kernel hook=tc (clsact)");
        r.parse("VMTEST check=revocation result=pass ms=42 detail=x y");
        r.parse("VMTEST check=detach result=fail ms=0 detail=");
        r.parse("VMTEST RESULT PASS");
        assert_eq!(
            (r.hook.as_str(), r.backend.as_str()),
            ("tc (clsact)", "kernel")
        );
        assert_eq!(
            r.checks.get("revocation").map(|c| (c.0, c.1)),
            Some((true, 42))
        );
        assert_eq!(r.checks.get("detach").map(|c| c.0), Some(false));
        assert!(r.passed);
    }
}
