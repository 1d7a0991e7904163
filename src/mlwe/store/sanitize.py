"""The credential sanitizer: nothing is stored or streamed before it has run.

``sanitize(obj)`` returns a new structure (dicts, lists, tuples, sets, strings;
other scalars pass through) with credentials replaced by ``[REDACTED]``. It
never mutates its input and is idempotent: ``sanitize(sanitize(x)) ==
sanitize(x)``.

Two independent nets, so that a secret is caught by what it is called *or* by
what it looks like:

* **Keys.** The value of a key that names a credential is redacted whole
  (nested containers included): password, passwd, passphrase, secret, token,
  api_key / apikey / api-key, authorization, auth, private_key, credential(s),
  access_key, client_secret, session, cookie. Matching ignores case and the
  separators ``_ - . space``, and finds the word anywhere in the key
  (``DB_PASSWORD``, ``x-api-key``, ``githubToken``, ``AWS_SECRET_ACCESS_KEY``).
  The same rule covers ``{"name": "DB_PASSWORD", "value": ...}`` entries
  (Kubernetes env, HTTP header lists), ``("Authorization", ...)`` pairs and
  ``["--password", value]`` argument lists.

  Decisions, so that metadata survives:

  - *Numbers under a secret key are redacted* (a numeric PIN or password is
    still a secret); ``None``, booleans and ``""`` are kept, as they hide
    nothing and tell an operator a setting was absent/on/off.
  - Keys that use "token" as a unit of text are metadata, not secrets, and are
    kept: ``token_count``, ``max_tokens``, ``max_new_tokens``, ``num_tokens``,
    ``tokens_per_s``, ``tokenizer``, ``pad_token``/``eos_token``/``pad_token_id``
    and the like. A bare ``tokens`` key or ``api_tokens`` is still secret.
  - Keys that *point at* a secret rather than hold it are kept: names ending
    in file, path, dir, name, ref, env, uri, url, endpoint, timeout, ttl, expiry
    (``secretName``, ``token_file``, ``api_key_env``, ``token_uri``,
    ``session_timeout``). Their values still go through the string patterns
    below.

* **Strings.** Secrets are found *inside* any string and replaced in place,
  keeping the surrounding text: PEM private-key blocks of any type (RSA, EC,
  DSA, OPENSSH, ENCRYPTED, PGP; certificates and public keys are kept); AWS
  access key ids (AKIA/ASIA/...); Google/Gemini API keys (AIza...) and OAuth
  access tokens (ya29.); OpenAI (sk-, sk-proj-), Anthropic (sk-ant-) and Stripe
  secret keys; GitHub (ghp_ gho_ ghu_ ghs_ ghr_ github_pat_), GitLab (glpat-),
  Hugging Face (hf_), npm (npm_) and Slack (xoxb- xoxp- xoxa- xapp-) tokens;
  JWTs; ``Bearer <token>``; ``Basic <base64 user:pass>``; passwords in URLs
  (``scheme://user:[REDACTED]@host``, user and host kept); assignments whose
  name is secret-looking (``DB_PASSWORD=...`` env lines, where an unquoted
  value runs to the end of the line, ``password: ...`` YAML, ``"api_key": "..."`` JSON text, ``aws_secret_access_key = ...``,
  ``?token=...`` query strings, ``Pwd=...;`` connection strings,
  ``Authorization: Bearer ...`` headers); and ``--password=...`` /
  ``--password ...`` command-line flags. A string that is a JSON document is
  parsed, sanitised as a structure and re-serialised (only if something
  changed), so a service-account JSON stored as text loses its private key.

What is not caught: a bare password with no secret-looking name around it
(``mysql -phunter2``) is indistinguishable from text; a JWT glued to a
preceding ``-`` or ``_`` (the price of linear time, see ``_TOKENS``); secrets
in dict *keys* (keys are kept as they are). Token patterns require the shapes
real tokens have (length, digits and capitals where the issuer guarantees
them), so UUIDs, hex digests, base64 model names, paths and emails are kept.

Performance: every regex is compiled once at import and runs in linear time
on hostile input (tested); a string shorter than any token with no ``=``, no
``:`` and not both a space and a ``-`` returns at once; each pattern family is
gated by a cheap substring test; key decisions are cached.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from functools import lru_cache
from typing import Any

__all__ = [
    "REDACTED",
    "contains_secret",
    "find_secrets",
    "is_secret_key",
    "sanitize",
    "sanitize_text",
]

#: What a secret is replaced with.
REDACTED = "[REDACTED]"

# --- keys ------------------------------------------------------------------------

#: Words that make a key secret, matched in the key lowered with separators removed.
_SECRET_WORDS = (
    "password",
    "passwd",
    "passphrase",
    "secret",  # also client_secret, secret_key, aws_secret_access_key
    "token",
    "apikey",
    "authorization",
    "privatekey",
    "credential",
    "accesskey",
    "session",
    "cookie",
)
#: Whole keys that are secret although too short to search for inside other keys.
_SECRET_EXACT = frozenset({"auth", "pass", "pw", "xauth"})
#: Extra whole keys accepted only inside text assignments (``Pwd=...;`` in an ODBC
#: connection string); as a dict key ``PWD`` is the shell's working directory.
_SECRET_EXACT_IN_TEXT = frozenset({"pwd"})

#: "token" as a unit of text (LLM metadata), removed before looking for secret words.
_TOKEN_METADATA = re.compile(
    r"tokeniz[a-z]*"
    r"|(?:max|min|num|total|prompt|completion|input|output|new|generated|context|eos|bos|pad"
    r"|unk|sep|cls|mask|special|additional)tokens?"
    r"|tokens?(?:count|counts|len|length|limit|limits|budget|usage|type|types|rate|per[a-z]*"
    r"|total|processed|seen|generated)"
)
#: Keys that point at a secret (where it lives, how long it lasts) rather than hold it.
_POINTER_SUFFIXES = (
    "file",
    "files",
    "path",
    "dir",
    "name",
    "names",
    "ref",
    "env",
    "uri",
    "url",
    "endpoint",
    "timeout",
    "ttl",
    "expiry",
    "expiresat",
    "expiresin",
)
_KEY_SEPARATORS = re.compile(r"[\s_.\-]+")
#: Keys that name the *identifier* of an API token (``token_id``, ``tokenId``) are
#: metadata: an audit record must be able to say which token was revoked. (Access
#: key ids and private key ids stay secret: their issuers treat them as such.)
_SECRET_EVEN_AS_ID = ("session", "cookie", "private", "secret", "pass", "access")


def _normalise_key(key: str) -> str:
    return _KEY_SEPARATORS.sub("", key).lower()


@lru_cache(maxsize=4096)
def is_secret_key(key: str) -> bool:
    """Whether a key (dict key, env var, header, flag) names a credential."""
    norm = _normalise_key(key)
    if not norm:
        return False
    if norm in _SECRET_EXACT:
        return True
    if norm.endswith(_POINTER_SUFFIXES):
        return False
    if norm.endswith(("tokenid", "tokenids")) and not any(
        w in norm for w in _SECRET_EVEN_AS_ID
    ):
        return False
    if "token" in norm:
        norm = _TOKEN_METADATA.sub("", norm)
    return any(word in norm for word in _SECRET_WORDS)


def _is_secret_assignment_key(key: str) -> bool:
    return is_secret_key(key) or _normalise_key(key) in _SECRET_EXACT_IN_TEXT


# --- strings -----------------------------------------------------------------------

#: A private key block (any type); an unterminated one is redacted to the end of text.
_PEM_PRIVATE = re.compile(
    r"-----BEGIN ([A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?)-----.*?(?:-----END \1-----|\Z)", re.S
)
#: scheme://user:password@host -- the password part; the user may be empty (redis).
#: (The scheme may not start inside a run of scheme characters, so "a.a.a..." is
#: scanned once, not once per dot.)
_URL_PASSWORD = re.compile(
    r"((?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]{0,30}://[^\s:/@?#\[\]]*:)([^\s/?#]+)@"
)

#: Tokens recognised by their shape alone. Each alternative is at least 20 characters,
#: which the fast path below relies on. Linear time on hostile input: an alternative
#: either matches (and consumes its run) or fails within a bounded distance (its
#: run stops at the first character outside its class), except the JWT, which
#: therefore may not start right after ``-`` or ``_`` ("eyJ-eyJ-...").
_TOKENS = re.compile(
    # Prefixes no word ends in: found even glued to a preceding word ("keyAKIA...",
    # "tokenghp_..."), which is how secrets get pasted into names and labels.
    r"(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Za-z0-9])"  # AWS key id
    r"|AIza[0-9A-Za-z_\-]{35}"  # Google / Gemini API key
    r"|ya29\.[0-9A-Za-z_\-]{20,}"  # Google OAuth access token
    r"|gh[pousr]_[A-Za-z0-9]{30,}"  # GitHub classic
    r"|github_pat_[A-Za-z0-9_]{22,}"  # GitHub fine-grained
    r"|glpat-[A-Za-z0-9_\-]{20,}"  # GitLab
    r"|npm_[A-Za-z0-9]{36,}"  # npm
    r"|xox[abposr]-[A-Za-z0-9\-]{15,}"  # Slack bot/user/app tokens
    r"|xapp-[0-9]-[A-Za-z0-9\-]{13,}"  # Slack app-level token
    # Prefixes that end ordinary words ("task-", "dash_"): only at a word start.
    r"|(?<![A-Za-z0-9])(?:"
    # OpenAI (sk-, sk-proj-), Anthropic (sk-ant-api03-): long, with digits and capitals
    r"sk-(?=[A-Za-z0-9_\-]{0,100}[0-9])(?=[A-Za-z0-9_\-]{0,100}[A-Z])[A-Za-z0-9_\-]{20,}"
    r"|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}"  # Stripe
    r"|hf_[A-Za-z0-9]{30,}"  # Hugging Face
    r"|(?<![_\-])eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"  # JWT
    r")"
)
_BEARER = re.compile(r"(\b[Bb]earer\s+)([A-Za-z0-9\-._~+/]{13,}=*)")
#: ``Basic <base64>``: redacted only if it decodes to ``user:password``, so that the
#: word "Basic" in prose is left alone.
_BASIC = re.compile(r"(\bBasic\s+)([A-Za-z0-9+/]{8,}={0,2})(?![A-Za-z0-9+/=])")

_AUTH_SCHEME = r"(?P<scheme>(?i:bearer|basic|token|digest|bot|apikey|negotiate)[ \t]+)?"
#: A line of an env file, INI or YAML (``KEY=value``, ``export KEY=value``,
#: ``key = value``, ``key: value``): an unquoted value runs to the end of the line,
#: so ``DB_PASSWORD=Tr0ub4dor&3`` loses all of it. Quoted values are left to
#: ``_ASSIGNMENT``.
_LINE_ASSIGNMENT = re.compile(
    r"^(?P<lead>[ \t]*(?:export[ \t]+|-[ \t]+)?)"
    r"(?P<key>[A-Za-z_][A-Za-z0-9_.\-]*)"
    r"(?P<sep>[ \t]*(?:=|:(?![/\\]{2}))[ \t]*)"
    + _AUTH_SCHEME
    + r"(?P<val>(?![\"'\[|>\s])[^\n]*[^\s])",
    re.M,
)
#: ``name = value`` / ``name: value`` / ``"name": "value"`` inside text; the callback
#: decides by the name. A ``:`` followed by ``//`` is a URL scheme, not an assignment.
_ASSIGNMENT = re.compile(
    r"(?P<key>(?<![A-Za-z0-9_.\-])-{0,2}[A-Za-z_][A-Za-z0-9_.\-]*)"
    r"(?P<sep>[\"']?[ \t]*(?:=|:(?![/\\]{2}))[ \t]*)"
    + _AUTH_SCHEME
    + r"(?P<val>\[REDACTED\]|\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*'|[^\s,;&\"'<>(){}\[\]]+)"
)
#: ``--flag value`` (the ``--flag=value`` form is an assignment).
_FLAG_VALUE = re.compile(
    r"(?P<flag>(?<![\w\-])--?[A-Za-z][A-Za-z0-9_\-]*)(?P<sp>[ \t]+)"
    r"(?P<val>\"[^\"]*\"|'[^']*'|(?!-)[^\s\"']+)"
)
#: A whole string that is a flag (``--password``) in an argument list.
_FLAG_ALONE = re.compile(r"--?[A-Za-z][A-Za-z0-9_\-]*")
#: Cheap gate for the name-based string rules (searched in the lowered text).
_SECRET_HINT = re.compile("pass|pw|secret|token|key|auth|credential|session|cookie")

#: No token pattern matches fewer characters than this.
_MIN_TOKEN_LEN = 20


def _redact_quoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return f"{value[0]}{REDACTED}{value[0]}"
    return REDACTED


def _assignment(m: re.Match[str]) -> str:
    if not _is_secret_assignment_key(m.group("key")):
        return m.group(0)
    whole, start = m.group(0), m.start(0)
    head, tail = whole[: m.start("val") - start], whole[m.end("val") - start :]
    return f"{head}{_redact_quoted(m.group('val'))}{tail}"


def _flag_value(m: re.Match[str]) -> str:
    if not is_secret_key(m.group("flag")):
        return m.group(0)
    return f"{m.group('flag')}{m.group('sp')}{_redact_quoted(m.group('val'))}"


def _basic(m: re.Match[str]) -> str:
    try:
        decoded = base64.b64decode(m.group(2), validate=True)
    except (binascii.Error, ValueError):
        return m.group(0)
    return f"{m.group(1)}{REDACTED}" if b":" in decoded else m.group(0)


def _json_document(text: str) -> str | None:
    """The sanitised re-serialisation of a JSON object/array string, None if not one."""
    stripped = text.strip()
    if len(stripped) < 2 or (stripped[0], stripped[-1]) not in (("{", "}"), ("[", "]")):
        return None
    try:
        doc = json.loads(stripped)
    except ValueError:
        return None
    clean = _walk(doc)
    if clean == doc:
        return text
    return json.dumps(clean, ensure_ascii=False)


def sanitize_text(text: str) -> str:
    """``text`` with every secret found inside it replaced by ``[REDACTED]``."""
    if (
        len(text) < _MIN_TOKEN_LEN
        and "=" not in text
        and ":" not in text
        and not (" " in text and "-" in text)
    ):
        return text  # too short for a token, no assignment, no URL, no flag with a value
    as_json = _json_document(text)
    if as_json is not None:
        return as_json
    out = text
    if "PRIVATE KEY" in out:
        out = _PEM_PRIVATE.sub(REDACTED, out)
    if "://" in out and "@" in out:
        out = _URL_PASSWORD.sub(rf"\1{REDACTED}@", out)
    out = _TOKENS.sub(REDACTED, out)
    if "earer" in out:
        out = _BEARER.sub(rf"\1{REDACTED}", out)
    if "Basic" in out:
        out = _BASIC.sub(_basic, out)
    has_assignment = "=" in out or ":" in out
    has_flag = "-" in out
    if (has_assignment or has_flag) and _SECRET_HINT.search(out.lower()):
        if has_assignment:
            out = _LINE_ASSIGNMENT.sub(_assignment, out)
            out = _ASSIGNMENT.sub(_assignment, out)
        if has_flag:
            out = _FLAG_VALUE.sub(_flag_value, out)
    return out


# --- structures --------------------------------------------------------------------


def _redactable(value: Any) -> bool:
    """Whether a value under a secret key hides something (see module doc)."""
    if value is None or isinstance(value, bool):
        return False
    return not (isinstance(value, str) and value in ("", REDACTED))


def _names_secret_entry(d: dict[Any, Any]) -> bool:
    """``{"name": "DB_PASSWORD", "value": ...}`` (Kubernetes env, header lists)."""
    for k, v in d.items():
        if (
            isinstance(k, str)
            and k.lower() in ("name", "key")
            and isinstance(v, str)
            and is_secret_key(v)
        ):
            return True
    return False


def _walk_dict(d: dict[Any, Any]) -> dict[Any, Any]:
    entry_is_secret = _names_secret_entry(d)
    out: dict[Any, Any] = {}
    for k, v in d.items():
        if isinstance(k, str) and (is_secret_key(k) or (entry_is_secret and k.lower() == "value")):
            out[k] = REDACTED if _redactable(v) else v
        else:
            out[k] = _walk(v)
    return out


def _walk_sequence(items: list[Any] | tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    redact_next = False
    for item in items:
        if (
            redact_next
            and _redactable(item)
            and not (isinstance(item, str) and item.startswith("-"))
        ):
            out.append(REDACTED)
            redact_next = False
            continue
        redact_next = (
            isinstance(item, str)
            and _FLAG_ALONE.fullmatch(item) is not None
            and is_secret_key(item)
        )
        out.append(_walk(item))
    return out


def _walk(obj: Any) -> Any:
    if isinstance(obj, str):
        return sanitize_text(obj)
    if isinstance(obj, dict):
        return _walk_dict(obj)
    if isinstance(obj, list):
        return _walk_sequence(obj)
    if isinstance(obj, tuple):
        # ("Authorization", "Bearer ...") header pairs
        if len(obj) == 2 and isinstance(obj[0], str) and is_secret_key(obj[0]):
            return (obj[0], REDACTED if _redactable(obj[1]) else obj[1])
        return tuple(_walk_sequence(obj))
    if isinstance(obj, (set, frozenset)):
        return type(obj)(_walk(item) for item in obj)
    return obj


def sanitize(obj: Any) -> Any:
    """A copy of ``obj`` with every credential replaced by ``[REDACTED]``.

    Dicts come back as plain dicts, lists as lists, tuples as tuples (named
    tuples as plain tuples), sets as sets; other values are returned as they
    are. The input is never modified.
    """
    return _walk(obj)


def contains_secret(obj: Any) -> bool:
    """Whether ``sanitize`` would change anything in ``obj``."""
    return bool(_walk(obj) != obj)


def find_secrets(obj: Any, path: str = "") -> list[str]:
    """The paths (``labels.api_key``, ``command[2]``, ``name``) at which ``sanitize``
    would change ``obj``: where a credential is, or a credential-shaped value.

    The engine refuses a spec with any such path instead of storing it altered: what
    it accepts is stored exactly and comes back from a restart unchanged.
    """
    if _walk(obj) == obj:
        return []
    if isinstance(obj, dict):
        found: list[str] = []
        entry_is_secret = _names_secret_entry(obj)
        for k, v in obj.items():
            here = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and (
                is_secret_key(k) or (entry_is_secret and k.lower() == "value")
            ):
                if _redactable(v):
                    found.append(here)
                continue
            found += find_secrets(v, here)
        return found or [path]
    if isinstance(obj, list | tuple):
        found = []
        for i, item in enumerate(obj):
            found += find_secrets(item, f"{path}[{i}]")
        return found or [path]  # a secret flag's value: the pair, not one item
    return [path]
