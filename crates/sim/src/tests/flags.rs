//! The CLI flags: clap's defaults against `SimArgs::default()`, and invalid flags refused at
//! start.

use clap::Parser;

use crate::{SimArgs, start};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
}

#[test]
fn clap_defaults_match_default() {
    let parsed = Cli::try_parse_from(["sim"]).unwrap().sim;
    let d = SimArgs::default();
    assert_eq!(parsed.port, 8001);
    assert_eq!(
        format!("{:?}", SimArgs { port: 0, ..parsed }),
        format!("{d:?}")
    );
    let names = Cli::try_parse_from([
        "sim",
        "--served-model-name",
        "a,b",
        "--served-model-name",
        "c",
    ])
    .unwrap()
    .sim
    .served_model_name;
    assert_eq!(names, ["a", "b", "c"]);
}

#[tokio::test]
async fn invalid_flags_are_rejected() {
    for bad in [
        SimArgs {
            fail_rate: 1.5,
            ..SimArgs::default()
        },
        SimArgs {
            max_num_seqs: 64,
            max_num_batched_tokens: 32,
            ..SimArgs::default()
        },
        SimArgs {
            decode_step_ms: -1.0,
            ..SimArgs::default()
        },
        SimArgs {
            first_token_at_once: true,
            stall_first_token_ms: 5.0,
            ..SimArgs::default()
        },
    ] {
        let err = start(bad).await.err().unwrap();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    }
}
