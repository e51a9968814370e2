//! Sequences of states planned fully and incrementally against the model of the kernel, every
//! invariant checked after every operation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wgfence_fuzz::Scenario;

fuzz_target!(|scenario: Scenario| {
    if let Err(e) = wgfence_fuzz::check_plans(&scenario) {
        panic!("{e}\nscenario: {scenario:?}");
    }
});
