"""The Python client of the daemon: :class:`Client` (blocking; used by the
CLI and the tests) and :class:`AsyncClient` (anyio), the same commands over
one connection per request. A generation is an iterator of text pieces::

    client = Client()
    client.load("builtin:tiny")
    with client.generate("tiny", "Hello", max_tokens=32) as gen:
        for text in gen:
            print(text, end="")
    print(gen.done.generation_tps)

Read :mod:`supervisor.client.commands` for the commands and their options
(both clients take their methods from it), :mod:`supervisor.client.blocking`
and :mod:`supervisor.client.aio` for the two transports.
"""

from supervisor.client.aio import AsyncClient, AsyncGeneration
from supervisor.client.blocking import Client, Generation
from supervisor.client.commands import local_model_reference
from supervisor.client.connection import (
    DAEMON_UID_ENV,
    check_daemon_credentials,
    expected_daemon_uid,
)
from supervisor.client.errors import ClientError, DaemonUnreachable

__all__ = [
    "DAEMON_UID_ENV",
    "AsyncClient",
    "AsyncGeneration",
    "Client",
    "ClientError",
    "DaemonUnreachable",
    "Generation",
    "check_daemon_credentials",
    "expected_daemon_uid",
    "local_model_reference",
]
