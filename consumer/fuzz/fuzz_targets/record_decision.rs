//! The libFuzzer target of the record path: [`consumer_fuzz::check`] on every input libFuzzer
//! makes (scripts/fuzz.sh). Built only by cargo fuzz, with the `libfuzzer` feature.
#![no_main]

libfuzzer_sys::fuzz_target!(|r: consumer_fuzz::Record| consumer_fuzz::check(&r));
