//! `docs/job-spec.md` is the reference generated from the API's schema: a change to the job
//! spec that does not regenerate it fails here, saying how to.

#[test]
fn the_job_spec_reference_is_current() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/job-spec.md");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    let generated = proteus_broker::api::spec_doc::job_spec_reference();
    assert!(
        committed == generated,
        "docs/job-spec.md is not current: run `cargo run -p proteus-broker -- openapi --job-spec > docs/job-spec.md`"
    );
}
