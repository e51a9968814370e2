//! Loading the embedded object, or adopting the programs a running datapath pinned: a restart
//! that finds the programs of this very object (its log level, its variant) running on both
//! links with the maps pinned now takes them over without verifying them again; otherwise the
//! object's programs are loaded, and pinned for the next start.

use std::{
    fs,
    io::ErrorKind,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{
    maps::MapData,
    programs::SchedClassifier,
    {Ebpf, EbpfLoader},
};
use wgfence_common::{map_names, Variant};

use super::{
    pins::remove_if_exists, program_err, tick, Dataplane, DataplaneError, Hook, Maps, Result,
    AYA_LOG_LEVEL, OBJECT,
};

/// Loads the object with every map at its pin under `pin_dir` (the pinned map reused if there
/// is one, else created and pinned), checks the maps' layout, and opens the pins a second time.
/// With the time since `started` at which the object was loaded.
#[allow(clippy::type_complexity)]
pub(super) fn load_object(
    pin_dir: &Path,
    log_level: u8,
    started: Instant,
) -> Result<(Ebpf, Maps, Vec<(&'static str, MapData)>, Duration)> {
    let pins: Vec<(&'static str, PathBuf)> = map_names::ALL
        .iter()
        .map(|name| (*name, pin_dir.join(name)))
        .collect();
    let mut loader = EbpfLoader::new();
    loader.override_global(AYA_LOG_LEVEL, &log_level, false);
    loader.override_global(tick::JIFFY_NS_GLOBAL, tick::jiffy_ns(), true);
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    let mut ebpf = loader.load(OBJECT)?;
    let object = started.elapsed();
    // Before anything is attached: an adopted map of another layout is an error.
    let mut maps = Maps::from_ebpf(&mut ebpf, Some(pin_dir))?;
    // The tries' directories are part of what an attach pins, policies or not. Tries an
    // adopted array of maps holds without their pins read as empty, and the first plan writes
    // them again.
    maps.restore_tries_dirs()?;
    let map_pins = pins
        .iter()
        .map(|(name, path)| {
            MapData::from_pin(path)
                .map(|data| (*name, data))
                .map_err(|source| DataplaneError::Map { map: name, source })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((ebpf, maps, map_pins, object))
}

/// The running programs, if `may_adopt` and they are this very object's and use these very
/// maps: taken over as they are, without loading and verifying them again (see
/// [`adopt_programs`]); else none, and the object's are loaded.
pub(super) fn adopt_or_load(
    pin_dir: &Path,
    hooks: &[Hook; 2],
    identity: &str,
    map_pins: &[(&'static str, MapData)],
    ebpf: &mut Ebpf,
    may_adopt: bool,
) -> Result<Vec<(&'static str, SchedClassifier)>> {
    let adopted = if may_adopt {
        adopt_programs(pin_dir, hooks, identity, map_pins)
    } else {
        Vec::new()
    };
    if adopted.is_empty() {
        load_programs(pin_dir, hooks, ebpf)?;
    }
    Ok(adopted)
}

/// Loads (verifies) the variant's two programs of the object, after removing the pins of the
/// programs they replace.
fn load_programs(pin_dir: &Path, hooks: &[Hook; 2], ebpf: &mut Ebpf) -> Result<()> {
    // Pins of programs about to be replaced: gone before the switch, so that none names a
    // program the links no longer run.
    remove_program_pins(pin_dir, hooks)?;
    // Both programs are verified before either is switched: the two link updates (or filter
    // replacements) follow each other without a verifier run between them. Only the variant's
    // two programs are loaded; the other variant's stay in the object.
    for hook in hooks {
        let program = classifier(ebpf, hook.program)?;
        program.load().map_err(program_err(hook.program))?;
    }
    Ok(())
}

/// Pins the programs: what the next start may take over instead of loading the object again.
/// A failure costs that start the verifier's time, no enforcement.
pub(super) fn keep_programs(pin_dir: &Path, hooks: &[Hook; 2], identity: &str, ebpf: &mut Ebpf) {
    if let Err(e) = pin_programs(pin_dir, hooks, identity, ebpf) {
        tracing::warn!(
            pin_dir = %pin_dir.display(),
            error = %crate::error_chain(&e),
            "could not pin the programs: the next start loads them again"
        );
    }
}

pub(crate) fn classifier<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut SchedClassifier> {
    ebpf.program_mut(program)
        .ok_or(DataplaneError::Program {
            program,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?
        .try_into()
        .map_err(program_err(program))
}

/// The program named `name`: the adopted one if the running programs were taken over, else
/// the object's.
pub(super) fn program_of<'a>(
    ebpf: &'a mut Ebpf,
    adopted: &'a mut [(&'static str, SchedClassifier)],
    name: &'static str,
) -> Result<&'a mut SchedClassifier> {
    match adopted.iter_mut().find(|(n, _)| *n == name) {
        Some((_, program)) => Ok(program),
        None => classifier(ebpf, name),
    }
}

/// What identifies the programs an attach loads: the object, the log level compiled into it
/// and the variant. Part of the programs' pin names (`prog_<direction>_<identity>`): an agent
/// built from another object never takes over these programs.
pub(super) fn program_identity(log_level: u8, variant: &Variant) -> String {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same on every start of the same binary (a toolchain that
    // hashes differently only costs one start the verifier's time).
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new();
    OBJECT.hash(&mut hasher);
    log_level.hash(&mut hasher);
    variant.name.hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// The pin of the program of `hook` with this identity.
pub(super) fn program_pin(pin_dir: &Path, hook: &Hook, identity: &str) -> PathBuf {
    pin_dir.join(format!("{PROGRAM_PIN_PREFIX}{}_{identity}", hook.direction))
}

/// Name prefix of the program pins in a pin directory.
pub(super) const PROGRAM_PIN_PREFIX: &str = "prog_";

/// Takes over the programs the pinned links run, if they are exactly what this attach would
/// load: pinned under this binary's identity by an agent that loaded them, run by both pinned
/// links (the kernel's program ids), and using exactly the maps pinned now (their ids). Any
/// other answer, or any error, is an empty result: the caller loads and verifies the object's
/// programs, as a first start does.
fn adopt_programs(
    pin_dir: &Path,
    hooks: &[Hook; 2],
    identity: &str,
    map_pins: &[(&'static str, MapData)],
) -> Vec<(&'static str, SchedClassifier)> {
    // The pinned maps by their kernel names (truncated as the kernel keeps them).
    let mut pinned = Vec::with_capacity(map_pins.len());
    for (_, map) in map_pins {
        match map.info() {
            Ok(info) => pinned.push((info.name().to_vec(), info.id())),
            Err(_) => return Vec::new(),
        }
    }
    let mut adopted = Vec::with_capacity(hooks.len());
    for hook in hooks {
        let pin = program_pin(pin_dir, hook, identity);
        let link = pin_dir.join(hook.link_pin);
        if !pin.exists() || !link.exists() {
            return Vec::new();
        }
        let Ok(program) = SchedClassifier::from_pin(&pin) else {
            return Vec::new();
        };
        let Ok(info) = program.info() else {
            return Vec::new();
        };
        let Ok(Some((_, linked))) = Dataplane::pinned_link_info_at(&link) else {
            return Vec::new();
        };
        let Ok(Some(uses)) = info.map_ids() else {
            return Vec::new();
        };
        if linked != info.id() {
            return Vec::new();
        }
        // The maps a program uses are fixed when it is loaded: each of its maps named like a
        // pinned one must be that very map (a map pin replaced since would leave the program
        // enforcing a map the agent no longer writes).
        let mut matched = 0;
        for id in uses {
            let Ok(map) = aya::maps::MapInfo::from_id(id) else {
                return Vec::new();
            };
            if let Some((_, pinned_id)) = pinned.iter().find(|(name, _)| name == map.name()) {
                if *pinned_id != id {
                    return Vec::new();
                }
                matched += 1;
            }
        }
        if matched == 0 {
            return Vec::new();
        }
        adopted.push((hook.program, program));
    }
    tracing::debug!(pin_dir = %pin_dir.display(), "took over the running programs");
    adopted
}

/// Pins the loaded programs under `identity`, for the next start to take over.
fn pin_programs(pin_dir: &Path, hooks: &[Hook; 2], identity: &str, ebpf: &mut Ebpf) -> Result<()> {
    for hook in hooks {
        let path = program_pin(pin_dir, hook, identity);
        remove_if_exists(&path)?;
        classifier(ebpf, hook.program)?
            .pin(&path)
            .map_err(|source| DataplaneError::Pin {
                path: path.clone(),
                source,
            })?;
    }
    Ok(())
}

/// Removes every program pin of `hooks` in `pin_dir`, whatever its identity.
fn remove_program_pins(pin_dir: &Path, hooks: &[Hook; 2]) -> Result<()> {
    let entries = match fs::read_dir(pin_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(DataplaneError::Io {
                path: pin_dir.to_owned(),
                source,
            })
        }
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let name = name.to_str().unwrap_or_default();
        if hooks.iter().any(|hook| {
            name.strip_prefix(PROGRAM_PIN_PREFIX)
                .and_then(|rest| rest.strip_prefix(hook.direction))
                .is_some_and(|rest| rest.starts_with('_'))
        }) {
            remove_if_exists(&entry.path())?;
        }
    }
    Ok(())
}
