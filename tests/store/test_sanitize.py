"""The credential sanitizer, against a corpus of realistic (fake) secrets.

Every secret below is embedded somewhere in ``CORPUS`` (a workload spec with
env, args and labels, an env file, log lines, headers, JSON stored as text, a
service-account key) and must be gone from the sanitised, serialised output.
Ordinary values (names, numbers, paths, digests, model ids, token counts) must
come through unchanged.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest

from mlwe.store.sanitize import REDACTED, contains_secret, is_secret_key, sanitize, sanitize_text

PEM_BODY_RSA = (
    "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun",
    "VTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK",
)
PEM_BODY_EC = ("MHcCAQEEIBYr9XzGmX3aKQ2nE7yBbX0n8sPjV1tW4kQeRrZ0C5vHoAoGCCqGSM49",)
PEM_BODY_OPENSSH = ("b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW",)
PEM_BODY_ENCRYPTED = ("MIIFHzBJBgkqhkiG9w0BBQ0wPDAbBgkqhkiG9w0BBQwwDgQIq3X9c0H1f3ICAggA",)
PEM_BODY_GCP = ("MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQDQxW2pTq8Zr9Kj",)


def pem(kind: str, body: tuple[str, ...]) -> str:
    return f"-----BEGIN {kind}-----\n" + "\n".join(body) + f"\n-----END {kind}-----\n"


#: name -> the secret value that must not survive (each appears in CORPUS).
SECRETS: dict[str, str] = {
    "aws_access_key_id": "AKIAZ7QX4MLWE3EXAMP1",
    "aws_sts_key_id": "ASIAY34FZKBOKMUTVV7A",
    "aws_secret_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzMLWE3KEYq",
    "gcp_private_key": PEM_BODY_GCP[0],
    "gcp_private_key_id": "3f9a1c2b7d4e5f60718293a4b5c6d7e8f9012345",
    "google_api_key": "AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe",
    "gemini_api_key": "AIzaSyB7rT2xQ9mV4kL1pN8wZ3cY6hJ0fD5sEaU",
    "google_oauth_token": "ya29.a0AfB_byC3xT7qLmN9pR2sV5wY8zA1bD4eG6hJ",
    "openai_legacy": "sk-Fq3bT9xL2mV7kP4wR8nZ1cY5hJ0dG6sA3eU9iO2qW7tB4xMv",
    "openai_project": "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAB7cDE0fGH3iJK6lMN9oPQ2rST5u",
    "anthropic": "sk-ant-api03-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa9Zy8Xw7Vu6Ts5RqAA",
    "stripe": "sk_live_51HqLmWE3xT7bN2vR9cK4pY8zQ",
    "github_classic": "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
    "github_oauth": "gho_9aZ8bY7cX6dW5eV4fU3gT2hS1iR0jQ9kP8lO",
    "github_server": "ghs_4kT7mQ2xL9vB3nR8cW1pZ6yH5jD0sF2gA7eU",
    "github_user": "ghu_Q1w2E3r4T5y6U7i8O9p0A1s2D3f4G5h6J7k8",
    "github_refresh": "ghr_1B4a2e77838347a7E420ce178F2E7c6912E169",
    "github_fine_grained": "github_pat_11ABCDEFG0aBcDeFgHiJkL_mNoPqRsTuVwXyZ0123456789abcdefGHIJKLmnop",
    "gitlab": "glpat-xT7bN2vR9cK4pY8zQ1mW",
    "huggingface": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567",
    "npm": "npm_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
    "slack_bot": "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "slack_user": "xoxp-210987654321-2109876543210-9876543210987-ab12cd34ef56ab78cd90",
    "slack_app": "xapp-1-A0123ABCDEF-1234567890123-0123456789abcdef0123456789abcdef",
    "jwt": (
        "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6Im1sd2UifQ"
        ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
    ),
    "bearer_opaque": "8f3c1e2a9b7d4c6e5f0a1b2c3d4e5f6a",
    "basic_auth": "YWRtaW46aHVudGVyMg==",  # admin:hunter2
    "postgres_url_password": "Pg-Pr0d-Passw0rd",
    "redis_url_password": "r3d1sS3cretValue",
    "mongo_url_password": "M0ng0Atl4sPass",
    "rsa_private_key": PEM_BODY_RSA[1],
    "ec_private_key": PEM_BODY_EC[0],
    "openssh_private_key": PEM_BODY_OPENSSH[0],
    "encrypted_private_key": PEM_BODY_ENCRYPTED[0],
    "env_db_password": "Tr0ub4dor&3horse",
    "env_django_secret": "django-insecure-9x!v@q2k#m7p",
    "cli_password_flag": "CliPassw0rd!",
    "cli_token_space": "opaqueCliToken42xyz",
    "k8s_env_value": "k8sEnvSecretValue77",
    "x_api_key_header": "hdr-key-5d41402abc4b2a76b",
    "cookie_session": "s%3AkT9vR2mX.Qz8",
    "json_in_string_password": "jsonStrPassw0rd",
    "numeric_pin": "987654321",
    "odbc_pwd": "0dbcPwdValue",
    "query_token": "qs0paqueT0ken",
    "yaml_password": "yamlPassw0rd",
    "webhook_secret": "whsec_notARealOne_123",
}

SERVICE_ACCOUNT = {
    "type": "service_account",
    "project_id": "mlwe-prod",
    "private_key_id": SECRETS["gcp_private_key_id"],
    "private_key": pem("PRIVATE KEY", PEM_BODY_GCP),
    "client_email": "trainer@mlwe-prod.iam.gserviceaccount.com",
    "client_id": "112233445566778899000",
    "token_uri": "https://oauth2.googleapis.com/token",
}

ENV_FILE = f"""# .env for the fine-tuning job
MODEL_NAME=meta-llama/Meta-Llama-3-8B
DB_PASSWORD={SECRETS["env_db_password"]}
DJANGO_SECRET_KEY="{SECRETS["env_django_secret"]}"
OUTPUT_DIR=/data/runs/ft-42
export GITHUB_TOKEN={SECRETS["github_classic"]}
OPENAI_API_KEY={SECRETS["openai_legacy"]}
"""

AWS_CREDENTIALS_FILE = f"""[default]
aws_access_key_id = {SECRETS["aws_access_key_id"]}
aws_secret_access_key = {SECRETS["aws_secret_key"]}
region = us-east-1
"""

YAML_CONFIG = f"""database:
  host: db.internal
  user: mlwe
  password: {SECRETS["yaml_password"]}
tls:
  key: |
{"".join("    " + line + chr(10) for line in pem("EC PRIVATE KEY", PEM_BODY_EC).splitlines())}
"""

CORPUS: dict[str, Any] = {
    "workload": {
        "name": "llama3-ft-42",
        "queue": "research",
        "priority": 100,
        "replicas": 4,
        "resources": {"gpu": 8, "gpu_model": "H100", "memory_mib": 512_000},
        "image": "nvcr.io/nvidia/pytorch:24.01-py3",
        "command": [
            "python",
            "train.py",
            f"--password={SECRETS['cli_password_flag']}",
            "--hf-token",
            SECRETS["cli_token_space"],
            "--epochs",
            "3",
            "--lr",
            "0.0001",
        ],
        "env": {
            "HF_TOKEN": SECRETS["huggingface"],
            "WANDB_PROJECT": "llama-ft",
            "AWS_ACCESS_KEY_ID": SECRETS["aws_access_key_id"],
            "NUM_WORKERS": "8",
        },
        "k8s_env": [
            {"name": "SLACK_BOT_TOKEN", "value": SECRETS["k8s_env_value"]},
            {"name": "CHECKPOINT_DIR", "value": "/ckpt/llama3-ft-42"},
            {"name": "DB_CREDS", "valueFrom": {"secretKeyRef": {"name": "db", "key": "pw"}}},
        ],
        "labels": {"team": "nlp", "owner": "alice", "pipeline": "ft-daily"},
        "annotations": {
            "notify": f"slack bot {SECRETS['slack_bot']}",
            "source": f"https://oauth2:{SECRETS['gitlab']}@gitlab.example.com/nlp/ft.git",
        },
        "token_count": 5,
        "max_new_tokens": 512,
        "tokenizer": "meta-llama/Meta-Llama-3-8B",
        "secretName": "llama-ft-secrets",
        "password_file": "/run/secrets/db_password",
    },
    "config_files": [ENV_FILE, AWS_CREDENTIALS_FILE, YAML_CONFIG],
    "service_account_json": json.dumps(SERVICE_ACCOUNT),
    "service_account": SERVICE_ACCOUNT,
    "headers": {
        "X-Api-Key": SECRETS["x_api_key_header"],
        "Cookie": f"sessionid={SECRETS['cookie_session']}; theme=dark",
        "Accept": "application/json",
    },
    "header_pairs": [
        ("Authorization", f"Bearer {SECRETS['bearer_opaque']}"),
        ("Content-Type", "application/json"),
    ],
    "log_lines": [
        f"connecting to postgresql://mlwe:{SECRETS['postgres_url_password']}@db:5432/mlwe",
        f"cache at redis://:{SECRETS['redis_url_password']}@cache:6379/0 ready",
        f"mongodb+srv://etl:{SECRETS['mongo_url_password']}@cluster0.abcde.mongodb.net/db",
        f"curl -H 'Authorization: Basic {SECRETS['basic_auth']}' https://registry/v2/",
        f"got jwt {SECRETS['jwt']} from idp",
        f"GET /v1/models?token={SECRETS['query_token']}&page=2 200",
        f"Server=sql01;Uid=sa;Pwd={SECRETS['odbc_pwd']};Database=metrics",
        f"gemini key {SECRETS['gemini_api_key']} rotated",
        f"using google key {SECRETS['google_api_key']}",
        f"oauth access {SECRETS['google_oauth_token']} expires in 3599s",
        f"STS creds {SECRETS['aws_sts_key_id']} issued",
    ],
    "agent": {
        "reasoning": (
            f"the LLM reasoner used {SECRETS['openai_project']} and fell back to "
            f"{SECRETS['anthropic']}"
        ),
        "billing": f"stripe {SECRETS['stripe']}",
        "github": [
            SECRETS["github_oauth"],
            SECRETS["github_server"],
            (SECRETS["github_user"], SECRETS["github_refresh"]),
            {"pat": SECRETS["github_fine_grained"]},
        ],
        "slack": {"user": SECRETS["slack_user"], "socket_mode": SECRETS["slack_app"]},
        "npm": f"//registry.npmjs.org/:_authToken={SECRETS['npm']}",
    },
    "keys": {
        "deploy": pem("RSA PRIVATE KEY", PEM_BODY_RSA),
        "ssh": pem("OPENSSH PRIVATE KEY", PEM_BODY_OPENSSH),
        "legacy": pem("ENCRYPTED PRIVATE KEY", PEM_BODY_ENCRYPTED),
    },
    "nested_json": json.dumps(
        {"db": {"user": "etl", "password": SECRETS["json_in_string_password"]}, "retries": 3}
    ),
    "device": {"pin": 1, "Password": int(SECRETS["numeric_pin"])},
    "webhooks": {"stripe_webhook_secret": SECRETS["webhook_secret"]},
}


def serialised(obj: Any) -> str:
    return json.dumps(obj, default=str, ensure_ascii=False)


@pytest.fixture(scope="module")
def clean() -> Any:
    return sanitize(CORPUS)


def test_corpus_has_at_least_30_secrets_and_each_is_really_in_it() -> None:
    assert len(SECRETS) >= 30
    raw = serialised(CORPUS)
    missing = [name for name, value in SECRETS.items() if value not in raw]
    assert missing == []


@pytest.mark.parametrize("name", sorted(SECRETS))
def test_secret_is_removed(name: str, clean: Any) -> None:
    assert SECRETS[name] not in serialised(clean)


def test_no_secret_survives_anywhere(clean: Any) -> None:
    out = serialised(clean)
    assert [n for n, v in SECRETS.items() if v in out] == []
    assert "PRIVATE KEY-----" + "\n" not in out
    assert REDACTED in out
    assert not contains_secret(clean)
    assert contains_secret(CORPUS)


def test_ordinary_values_are_kept(clean: Any) -> None:
    w = clean["workload"]
    assert w["name"] == "llama3-ft-42"
    assert w["priority"] == 100
    assert w["resources"] == CORPUS["workload"]["resources"]
    assert w["image"] == "nvcr.io/nvidia/pytorch:24.01-py3"
    assert w["command"][:2] == ["python", "train.py"]
    assert w["command"][2] == f"--password={REDACTED}"
    assert w["command"][3:] == ["--hf-token", REDACTED, "--epochs", "3", "--lr", "0.0001"]
    assert w["env"]["WANDB_PROJECT"] == "llama-ft"
    assert w["env"]["NUM_WORKERS"] == "8"
    assert w["k8s_env"][1] == {"name": "CHECKPOINT_DIR", "value": "/ckpt/llama3-ft-42"}
    assert w["k8s_env"][2] == CORPUS["workload"]["k8s_env"][2]  # a reference, not a secret
    assert w["labels"] == CORPUS["workload"]["labels"]
    # metadata that merely mentions tokens or points at a secret is kept
    assert w["token_count"] == 5
    assert w["max_new_tokens"] == 512
    assert w["tokenizer"] == "meta-llama/Meta-Llama-3-8B"
    assert w["secretName"] == "llama-ft-secrets"
    assert w["password_file"] == "/run/secrets/db_password"
    # URLs keep user and host, lose the password
    assert clean["log_lines"][0] == f"connecting to postgresql://mlwe:{REDACTED}@db:5432/mlwe"
    assert clean["log_lines"][1] == f"cache at redis://:{REDACTED}@cache:6379/0 ready"
    assert w["annotations"]["source"] == (
        f"https://oauth2:{REDACTED}@gitlab.example.com/nlp/ft.git"
    )
    assert clean["headers"]["Accept"] == "application/json"
    assert clean["headers"]["Cookie"] == REDACTED  # the whole cookie header: a secret key
    assert clean["header_pairs"][1] == ("Content-Type", "application/json")
    # the service account keeps everything but its key material
    sa = clean["service_account"]
    assert sa["client_email"] == SERVICE_ACCOUNT["client_email"]
    assert sa["private_key"] == REDACTED and sa["private_key_id"] == REDACTED
    assert sa["token_uri"] == SERVICE_ACCOUNT["token_uri"]
    sa_text = json.loads(clean["service_account_json"])
    assert sa_text["private_key"] == REDACTED
    assert sa_text["project_id"] == "mlwe-prod"
    nested = json.loads(clean["nested_json"])
    assert nested == {"db": {"user": "etl", "password": REDACTED}, "retries": 3}
    assert clean["device"] == {"pin": 1, "Password": REDACTED}


def test_text_around_secrets_is_kept(clean: Any) -> None:
    env = clean["config_files"][0]
    assert "MODEL_NAME=meta-llama/Meta-Llama-3-8B\n" in env
    assert "OUTPUT_DIR=/data/runs/ft-42\n" in env
    assert f"DB_PASSWORD={REDACTED}\n" in env
    assert f'DJANGO_SECRET_KEY="{REDACTED}"\n' in env
    assert f"export GITHUB_TOKEN={REDACTED}\n" in env
    aws = clean["config_files"][1]
    assert aws == (
        f"[default]\naws_access_key_id = {REDACTED}\naws_secret_access_key = {REDACTED}\n"
        "region = us-east-1\n"
    )
    yaml_text = clean["config_files"][2]
    assert "  host: db.internal\n  user: mlwe\n" in yaml_text
    assert f"  password: {REDACTED}\n" in yaml_text
    assert clean["log_lines"][3] == (
        f"curl -H 'Authorization: Basic {REDACTED}' https://registry/v2/"
    )
    assert clean["log_lines"][6] == f"Server=sql01;Uid=sa;Pwd={REDACTED};Database=metrics"
    assert clean["log_lines"][5] == f"GET /v1/models?token={REDACTED}&page=2 200"
    assert clean["header_pairs"][0] == ("Authorization", REDACTED)


@pytest.mark.parametrize(
    "text",
    [
        "550e8400-e29b-41d4-a716-446655440000",  # UUID
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",  # sha256
        "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "9fceb02d0ae598e95dc970b74767f19372d61af8",  # git commit (40 hex, like an AWS secret)
        "bWV0YS1sbGFtYS9MbGFtYS0yLTdiLWhm",  # base64 model name
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "s3://ml-datasets/imagenet/train-00042-of-01024.tfrecord",
        "gs://bucket/checkpoints/step-1000/",
        "https://huggingface.co/bert-base-uncased/resolve/main/config.json",
        "postgresql://mlwe@db.internal:5432/mlwe",  # a user but no password
        "alice@example.com",
        "nvcr.io/nvidia/pytorch:24.01-py3",
        "sk-learn-classifier-v2-final-model",  # not an OpenAI key: no capitals
        "task-force-alpha-2024-final-run-0001",
        "a Basic configuration for the bearer of the results",
        "priority: high, deadline: 2024-05-01T12:00:00Z",
        "python train.py --epochs 3 --lr 0.001 --batch-size 64",
        "max_tokens=4096 token_count=17 tokenizer=meta-llama/Llama-2-7b-hf",
        "checkpoint_path=/data/ckpt/llama3 secretName=db-creds",
        "preempted ft-7 (priority 50) for ft-9 (priority 100): frees 8 GPUs on node-a100-03",
        "AKIA is a prefix",
        "ghp_short",
        "eyJ not a jwt",
        "-----BEGIN CERTIFICATE-----\nMIIDdzCCAl+gAwIBAgIEAgAAuTANBgkqhkiG9w0BAQUFADBa\n-----END CERTIFICATE-----\n",
        "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END PUBLIC KEY-----\n",
        "",
        "ok",
    ],
)
def test_non_secrets_pass_unchanged(text: str) -> None:
    assert sanitize_text(text) == text
    assert not contains_secret(text)


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("password", True),
        ("DB_PASSWORD", True),
        ("passwd", True),
        ("x-api-key", True),
        ("apiKey", True),
        ("api key", True),
        ("githubToken", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("accessKeyId", True),
        ("client_secret", True),
        ("Authorization", True),
        ("Proxy-Authorization", True),
        ("private_key", True),
        ("credentials", True),
        ("Cookie", True),
        ("session", True),
        ("SESSION_ID", True),
        ("auth", True),
        ("tokens", True),  # a bare plural is still a container of tokens
        ("api_tokens", True),
        # metadata, kept
        ("token_count", False),
        ("max_tokens", False),
        ("max_new_tokens", False),
        ("num_tokens", False),
        ("tokens_per_s", False),
        ("tokenizer", False),
        ("tokenizer_path", False),
        ("pad_token_id", False),
        ("eos_token", False),
        ("secretName", False),
        ("token_file", False),
        ("api_key_env", False),
        ("session_timeout", False),
        ("author", False),
        ("PWD", False),  # the shell's working directory
        ("name", False),
        ("", False),
    ],
)
def test_secret_key_names(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret


def test_values_under_secret_keys() -> None:
    """Numbers are redacted (a PIN is a secret); None, booleans and "" hide nothing."""
    out = sanitize(
        {
            "password": 123456,
            "api_key": 3.5,
            "secret": None,
            "use_token": True,
            "token": "",
            "credentials": {"user": "a", "pass": "b"},
            "tokens": ["t1", "t2"],
        }
    )
    assert out == {
        "password": REDACTED,
        "api_key": REDACTED,
        "secret": None,
        "use_token": True,
        "token": "",
        "credentials": REDACTED,
        "tokens": REDACTED,
    }


def test_argument_lists() -> None:
    args = ["--password", "p4ss", "--token", "--verbose", "--api-key=k3y", "-v", "run"]
    assert sanitize(args) == [
        "--password",
        REDACTED,
        "--token",
        "--verbose",  # a flag, not a value
        f"--api-key={REDACTED}",
        "-v",
        "run",
    ]
    assert sanitize_text("train --session-dir /tmp/ray --secret s3cr3t!") == (
        f"train --session-dir /tmp/ray --secret {REDACTED}"
    )


def test_input_is_not_mutated_and_types_are_kept() -> None:
    before = copy.deepcopy(CORPUS)
    out = sanitize(CORPUS)
    assert before == CORPUS
    assert out is not CORPUS
    assert isinstance(out["header_pairs"][0], tuple)
    assert sanitize({"s": {"a", "b"}, "f": frozenset({"x"})}) == {
        "s": {"a", "b"},
        "f": frozenset({"x"}),
    }
    assert sanitize(7) == 7 and sanitize(None) is None and sanitize(1.5) == 1.5


def test_idempotent(clean: Any) -> None:
    assert sanitize(clean) == clean


def test_private_key_blocks_of_every_type() -> None:
    for kind in (
        "PRIVATE KEY",
        "RSA PRIVATE KEY",
        "EC PRIVATE KEY",
        "DSA PRIVATE KEY",
        "OPENSSH PRIVATE KEY",
        "ENCRYPTED PRIVATE KEY",
        "PGP PRIVATE KEY BLOCK",
    ):
        text = "before\n" + pem(kind, PEM_BODY_RSA) + "after"
        assert sanitize_text(text) == f"before\n{REDACTED}\nafter", kind
    # JSON-escaped newlines (a key pasted into a log line) and a truncated block
    escaped = 'key="-----BEGIN PRIVATE KEY-----\\nMIIEvQ\\n-----END PRIVATE KEY-----\\n" ok'
    assert "MIIEvQ" not in sanitize_text(escaped)
    assert sanitize_text("x -----BEGIN RSA PRIVATE KEY-----\nMIIEow") == f"x {REDACTED}"


@pytest.mark.parametrize(
    "text",
    [
        "a." * 100_000 + " https://u:p@h/ x@y",  # a URL scheme may start at every dot
        "sk-" * 50_000,  # a token may start at every dash
        ".eyJ" * 50_000,
        "eyJ-" * 50_000,
        "eyJ_abcdefghij" * 20_000,
        "sk-" + "a" * 200_000,
        "sk-a" * 50_000,
        "-----BEGIN RSA PRIVATE KEY-----" * 10_000,
        "--a " * 50_000 + "token",
        'password="' + "\\x" * 100_000,
        "s://u:" * 30_000 + "@",
    ],
    ids=[
        "dots-url",
        "sk-run",
        "jwt-run",
        "jwt-dash-run",
        "jwt-underscore-run",
        "sk-long",
        "sk-a-run",
        "pem-run",
        "flags",
        "quote",
        "urls",
    ],
)
def test_pathological_input_stays_linear(text: str) -> None:
    start = time.perf_counter()
    sanitize_text(text)
    # catastrophic backtracking on these inputs takes minutes; linear takes milliseconds
    assert time.perf_counter() - start < 15.0


@pytest.mark.parametrize(
    "text",
    [
        "keyAKIAIOSFODNN7EXAMPLE",  # glued to a word
        "tokenghp_" + "A1b2C3d4E5" * 4,
        "nameglpat-" + "x1Y2z3" * 4,
        "xAIza" + "B" * 35,
    ],
)
def test_a_secret_glued_to_a_word_is_caught(text: str) -> None:
    assert REDACTED in sanitize(text)


@pytest.mark.parametrize(
    "text",
    ["task-Run2024ExperimentAlphaBeta1", "dash_hf_" "notatoken", "desk-" + "Ab1" * 10],
)
def test_words_ending_in_a_token_prefix_are_kept(text: str) -> None:
    assert sanitize(text) == text


def test_the_id_of_a_token_is_not_a_secret() -> None:
    record = {"event": "token-revoked", "token_id": "tok-1a2b", "tokenId": "tok-1a2b"}
    assert sanitize(record) == record
    assert sanitize({"session_id": "abc123"})["session_id"] == REDACTED
    assert sanitize({"private_key_id": "abc"})["private_key_id"] == REDACTED


def test_find_secrets_names_every_path() -> None:
    from mlwe.store.sanitize import find_secrets

    doc = {"name": "ok", "labels": {"api_key": "x", "k": "keyAKIAIOSFODNN7EXAMPLE"},
           "command": ["run", "--password", "hunter2"], "env": {"PLAIN": "1"}}
    assert find_secrets(doc) == ["labels.api_key", "labels.k", "command"]
    assert find_secrets({"name": "clean"}) == []
