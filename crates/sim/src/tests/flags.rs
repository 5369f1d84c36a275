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

/// vLLM's LoRA flags: `--lora-modules` takes one or more values, plain or JSON, and the runtime
/// switch reads vLLM's spelling of true.
#[test]
fn lora_flags_parse_as_vllms() {
    let sim = Cli::try_parse_from([
        "sim",
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "64",
        "--lora-modules",
        "sql=/adapters/sql",
        r#"{"name": "chat", "path": "/adapters/chat", "base_model_name": "qwen32b"}"#,
        "--allow-runtime-lora-updating",
        "True",
    ])
    .unwrap()
    .sim;
    assert!(sim.enable_lora && sim.runtime_lora_updating);
    assert_eq!((sim.max_loras, sim.max_lora_rank), (4, 64));
    assert_eq!(sim.lora_modules.len(), 2);
    let off = Cli::try_parse_from(["sim", "--allow-runtime-lora-updating", "yes"])
        .unwrap()
        .sim;
    assert!(!off.runtime_lora_updating, "vLLM reads only 1 and true");
}
