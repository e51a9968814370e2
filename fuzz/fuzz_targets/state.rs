//! Any bytes as a state file: parsing never panics, the typed pass agrees with the value-tree
//! walk, and a valid state round-trips through its canonical JSON.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = wgfence_fuzz::check_state(text) {
            panic!("{e}\ninput: {text:?}");
        }
    }
});
