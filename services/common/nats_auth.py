"""Who may publish and subscribe to what on NATS: one identity (a NATS user) per service kind.

The server enforces it, so a message on a subject arrives only from an identity allowed to
publish there: a "dead" scheduler heartbeat can come only from a scheduler, a registration only
from a tokenizer, token batches only from a scheduler; an unauthenticated client gets nowhere.
`_INBOX.>` is shared by all: request replies and flow-control acks go to the asker's inbox.

`ops/nats/auth.conf` is rendered from `PERMISSIONS` (`render_authorization`; a test keeps the
committed file equal to it). Passwords are never in it: each is the server's environment
variable `SPARKWIRE_NATS_PASSWORD_<IDENTITY>`. `sparkwire up` draws fresh ones for its embedded
server (`draw_passwords`) and gives each child only its own, through its environment.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from contracts import subjects

INBOX = "_INBOX.>"
PASSWORD_VARIABLE = "SPARKWIRE_NATS_PASSWORD_{identity}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


PERMISSIONS: dict[str, Permissions] = {
    "tokenizer": Permissions(
        publish=(subjects.DETOKENIZER_REGISTER, subjects.SCHEDULER_CLAIM, subjects.scheduler_claim("*"),
                 subjects.scheduler_generate("*"), subjects.SCHEDULER_ABORT, subjects.SCHEDULER_PING,
                 subjects.SCHEDULER_FLUSH_CACHE, subjects.scheduler_control("*"), subjects.heartbeat("tokenizer"), INBOX),
        subscribe=(subjects.tokenizer_outputs("*"), subjects.PREFIX_SUMMARY, subjects.HEARTBEAT_ALL, INBOX),
    ),
    "detokenizer": Permissions(
        publish=(subjects.tokenizer_outputs("*"), subjects.SCHEDULER_ABORT, subjects.heartbeat("detokenizer"), INBOX),
        subscribe=(subjects.DETOKENIZER_REGISTER, subjects.detokenizer_tokens("*"), subjects.SCHEDULER_ABORT,
                   subjects.HEARTBEAT_ALL, INBOX),
    ),
    "scheduler": Permissions(
        publish=(subjects.detokenizer_tokens("*"), subjects.PREFIX_SUMMARY, subjects.heartbeat("scheduler"), INBOX),
        subscribe=(subjects.SCHEDULER_CLAIM, subjects.scheduler_claim("*"), subjects.scheduler_generate("*"),
                   subjects.SCHEDULER_ABORT, subjects.SCHEDULER_PING, subjects.SCHEDULER_FLUSH_CACHE,
                   subjects.scheduler_control("*"), subjects.scheduler_weights("*"), subjects.HEARTBEAT_ALL, INBOX),
    ),
    # `sparkwire push-weights` / `WeightPusher`: a trainer's weight pieces to each live scheduler.
    "trainer": Permissions(publish=(subjects.scheduler_weights("*"), INBOX), subscribe=(subjects.HEARTBEAT_ALL, INBOX)),
    # `sparkwire record` reads everything; `sparkwire replay` writes everything (operators only).
    "recorder": Permissions(publish=(INBOX,), subscribe=(subjects.ALL, INBOX)),
    "replay": Permissions(publish=(subjects.ALL, INBOX), subscribe=(INBOX,)),
}  # fmt: skip


def password_variable(identity: str) -> str:
    return PASSWORD_VARIABLE.format(identity=identity.upper())


def draw_passwords(identities: tuple[str, ...] = tuple(PERMISSIONS)) -> dict[str, str]:
    """Fresh random passwords, one per identity (`sparkwire up`'s embedded server). nats-server
    parses a variable's value as a config value: a leading letter keeps it a string (not a number)."""
    return {identity: "sw" + secrets.token_hex(24) for identity in identities}


def server_environ(passwords: dict[str, str]) -> dict[str, str]:
    """The variables `auth.conf` reads its passwords from."""
    return {password_variable(identity): password for identity, password in passwords.items()}


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f'"{value}"' for value in values)


def render_authorization() -> str:
    """The nats-server `authorization` block for every identity in `PERMISSIONS`."""
    users = []
    for identity, permissions in PERMISSIONS.items():
        users.append(
            f"    {{ user: {identity}, password: ${password_variable(identity)},\n"
            f"      permissions: {{ publish: {{ allow: [{_quoted(permissions.publish)}] }},\n"
            f"                     subscribe: {{ allow: [{_quoted(permissions.subscribe)}] }} }} }}"
        )
    header = "# Generated from services/common/nats_auth.py (PERMISSIONS); tests/deploy keep it equal.\n"
    return header + "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"
