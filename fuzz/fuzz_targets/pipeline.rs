//! Any bytes as a sequence of edits to a state file: the incremental state pipeline decides
//! every step exactly as a parse from scratch (state, changes, errors, plan); and the same
//! bytes as byte-level edits of a file's text, which the pipeline must decide alike too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = wgfence::state::edits::check_edits(data) {
        panic!("{e}\nedits: {data:?}");
    }
    if let Err(e) = wgfence::state::edits::check_splices(data) {
        panic!("{e}\nbyte edits: {data:?}");
    }
});
