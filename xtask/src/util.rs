//! Running commands (each printed before it runs) and the paths the tasks share.

use std::{
    env,
    ffi::{OsStr, OsString},
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
};

use anyhow::{bail, Context, Result};

/// Prints `cmd`, runs it, and fails unless it exits successfully.
pub fn run(cmd: &mut Command) -> Result<()> {
    let line = display(cmd);
    eprintln!("+ {line}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot run `{line}`"))?;
    check(status, &line)
}

/// Fails unless `status` is success, naming the command.
pub fn check(status: ExitStatus, line: &str) -> Result<()> {
    if status.success() {
        Ok(())
    } else {
        bail!("`{line}` failed ({status})")
    }
}

/// Runs a read-only query quietly: its stdout if it ran and succeeded, else `None`.
/// Queries are not printed; the tasks report what they found instead.
pub fn query(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The command as a shell line: explicitly set variables, program, arguments.
pub fn display(cmd: &Command) -> String {
    let mut words: Vec<String> = Vec::new();
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            words.push(format!(
                "{}={}",
                key.to_string_lossy(),
                quote(&value.to_string_lossy())
            ));
        }
    }
    words.push(quote(&cmd.get_program().to_string_lossy()));
    words.extend(cmd.get_args().map(|arg| quote(&arg.to_string_lossy())));
    let line = words.join(" ");
    match cmd.get_current_dir() {
        Some(dir) if env::current_dir().ok().as_deref() != Some(dir) => {
            format!("(cd {} && {line})", quote(&dir.to_string_lossy()))
        }
        _ => line,
    }
}

fn quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:=@%+,".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The workspace root: the directory above xtask/.
pub fn workspace_root() -> Result<PathBuf> {
    // Cargo sets CARGO_MANIFEST_DIR for `cargo run`; fall back to where xtask was built.
    let manifest_dir = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .with_context(|| format!("{} has no parent directory", manifest_dir.display()))
}

/// Cargo's target directory for the host crates (CARGO_TARGET_DIR, else `<root>/target`).
pub fn target_dir(root: &Path) -> PathBuf {
    match env::var_os("CARGO_TARGET_DIR").filter(|dir| !dir.is_empty()) {
        Some(dir) => env::current_dir().unwrap_or_default().join(dir),
        None => root.join("target"),
    }
}

/// The cargo that runs xtask (cargo sets CARGO), else `cargo` from PATH.
pub fn cargo() -> OsString {
    env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"))
}

/// A cargo command run in the workspace root.
pub fn cargo_command(root: &Path) -> Command {
    let mut cmd = Command::new(cargo());
    cmd.current_dir(root);
    cmd
}

pub fn home() -> Result<PathBuf> {
    env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(PathBuf::from)
        .context("HOME is not set")
}

/// `$CARGO_HOME`, default `~/.cargo`: where `cargo install` puts binaries (under bin/).
pub fn cargo_home() -> Result<PathBuf> {
    env_dir("CARGO_HOME", ".cargo")
}

/// `$RUSTUP_HOME`, default `~/.rustup`.
pub fn rustup_home() -> Result<PathBuf> {
    env_dir("RUSTUP_HOME", ".rustup")
}

/// `$XDG_DATA_HOME`, default `~/.local/share`.
pub fn data_home() -> Result<PathBuf> {
    env_dir("XDG_DATA_HOME", ".local/share")
}

fn env_dir(var: &str, default_in_home: &str) -> Result<PathBuf> {
    match env::var_os(var).filter(|dir| Path::new(dir).is_absolute()) {
        Some(dir) => Ok(dir.into()),
        None => Ok(home()?.join(default_in_home)),
    }
}

/// Appends `$CARGO_HOME/bin` to PATH unless it is there: the eBPF build finds `bpf-linker` via
/// PATH, and `cargo install` puts it there. Called once at start-up, before any thread exists.
pub fn add_cargo_bin_to_path() -> Result<()> {
    let bin = cargo_home()?.join("bin");
    let path = env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = env::split_paths(&path).collect();
    if !dirs.contains(&bin) {
        dirs.push(bin);
        let joined = env::join_paths(dirs).context("PATH contains an invalid directory")?;
        env::set_var("PATH", joined);
    }
    Ok(())
}

/// The first executable file called `name` in PATH.
pub fn find_in_path(name: impl AsRef<OsStr>) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(name.as_ref()))
        .find(|candidate| is_executable(candidate))
}

/// `name` from PATH, else from the system directories a non-root PATH lacks.
pub fn find_program(name: &str) -> Option<PathBuf> {
    find_in_path(name).or_else(|| {
        ["/usr/sbin", "/sbin"]
            .iter()
            .map(|dir| Path::new(dir).join(name))
            .find(|candidate| is_executable(candidate))
    })
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Whether this process runs with effective user id 0.
pub fn is_root() -> bool {
    // The second field of `Uid:` in /proc/self/status is the effective uid.
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_quotes_what_a_shell_would_split() {
        let mut cmd = Command::new("cargo");
        cmd.env("LLVM_PREFIX", "/a b")
            .args(["install", "--features", "llvm-22", "it's"]);
        assert_eq!(
            display(&cmd),
            r"LLVM_PREFIX='/a b' cargo install --features llvm-22 'it'\''s'"
        );
    }

    #[test]
    fn display_shows_empty_arguments() {
        let mut cmd = Command::new("x");
        cmd.arg("");
        assert_eq!(display(&cmd), "x ''");
    }
}
