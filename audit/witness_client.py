"""The log's side of c2sp.org/tlog-witness: asks one witness to cosign a checkpoint.

The client remembers the size the witness last cosigned for this log (0 at first). A 409 with
`text/x.tlog.size` says the witness knows another size (it restarted, or cosigned before this
process started): the client retries once from that size, with a new consistency proof. The
cosignature in a 200 answer is verified against the witness's pinned key before it is kept.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from audit.checkpoint import Checkpoint
from audit.cosignature import CosignerKey, verify_cosignatures
from audit.encoding import encode_base64, parse_decimal
from audit.errors import AuditError, WitnessDisagreesError, WitnessUnavailableError
from audit.note import SignedNote

ADD_CHECKPOINT = "add-checkpoint"
SIZE_CONTENT_TYPE = "text/x.tlog.size"
# A witness answers a few signature lines; anything longer is not a witness's answer.
MAX_RESPONSE_BYTES = 16 << 10

ConsistencyProof = Callable[[int, int], Sequence[bytes]]


@dataclass(frozen=True)
class WitnessEndpoint:
    """A witness the log asks: its submission prefix (http or https URL) and its pinned key."""

    url: str
    vkey: CosignerKey

    @property
    def name(self) -> str:
        return self.vkey.name


class _Conflict(Exception):
    def __init__(self, latest_size: int) -> None:
        self.latest_size = latest_size


class WitnessClient:
    """Asks one witness for cosignatures; used from one thread (audit.witnessing's)."""

    def __init__(self, endpoint: WitnessEndpoint, timeout_s: float) -> None:
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._known_size = 0
        # Reached directly: no proxy from the environment. Built here, not at import: its
        # HTTPS handler loads the system's CA certificates (50 ms of every start, W5).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def cosign(self, note: str, checkpoint: Checkpoint, proof: ConsistencyProof) -> str:
        """The witness's cosignature line for the signed `note` of `checkpoint`; `proof(old,
        new)` gives consistency proofs. Raises WitnessUnavailableError saying why not."""
        old_size = self._known_size if self._known_size <= checkpoint.size else 0
        for _ in range(2):
            try:
                line = self._add_checkpoint(note, checkpoint, old_size, proof)
            except _Conflict as conflict:
                if conflict.latest_size > checkpoint.size or conflict.latest_size == old_size:
                    # It cosigned a larger tree: a newer checkpoint (another process of this
                    # log, such as `inferno audit export`) or a fork. The next checkpoint tells.
                    raise WitnessDisagreesError(
                        f"witness {self.endpoint.name} refuses size {checkpoint.size}: it has "
                        f"cosigned size {conflict.latest_size} (a newer checkpoint of this log, "
                        "or one this tree does not extend)"
                    ) from None
                old_size = conflict.latest_size
                continue
            self._known_size = checkpoint.size
            return line
        raise WitnessUnavailableError(
            f"witness {self.endpoint.name} changed its size twice during one request"
        )

    def _add_checkpoint(
        self, note: str, checkpoint: Checkpoint, old_size: int, proof: ConsistencyProof
    ) -> str:
        hashes = proof(old_size, checkpoint.size) if 0 < old_size < checkpoint.size else []
        body = f"old {old_size}\n" + "".join(encode_base64(h) + "\n" for h in hashes)
        request = urllib.request.Request(
            self.endpoint.url.rstrip("/") + "/" + ADD_CHECKPOINT,
            data=(body + "\n" + note).encode(),
            method="POST",
            headers={"Content-Type": "text/plain; charset=utf-8"},
        )
        name = self.endpoint.name
        try:
            with self._opener.open(request, timeout=self._timeout_s) as response:
                answer = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            with exc:
                detail = exc.read(MAX_RESPONSE_BYTES + 1)
                content_type = exc.headers.get_content_type() if exc.headers else ""
            if exc.code == 409 and content_type == SIZE_CONTENT_TYPE:
                raise _Conflict(_parse_size(detail, name)) from None
            reason = detail[:200].decode("utf-8", "replace").strip()
            error = WitnessDisagreesError if exc.code in (409, 422) else WitnessUnavailableError
            raise error(f"witness {name} answered {exc.code}: {reason or exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise WitnessUnavailableError(f"witness {name} cannot be reached: {exc}") from None
        if len(answer) > MAX_RESPONSE_BYTES:
            raise WitnessUnavailableError(f"witness {name} answered over {MAX_RESPONSE_BYTES} B")
        return self._pick_cosignature(note, answer)

    def _pick_cosignature(self, note: str, answer: bytes) -> str:
        """The answer's line by the pinned key, verified; other keys' lines are ignored."""
        name = self.endpoint.name
        try:
            lines = answer.decode("utf-8").splitlines(keepends=True)
            mine = [
                line
                for line in lines
                if verify_cosignatures(SignedNote.parse(note + line), [self.endpoint.vkey])
            ]
        except (UnicodeDecodeError, AuditError) as exc:
            raise WitnessUnavailableError(
                f"witness {name} answered no valid cosignature: {exc}"
            ) from exc
        if not mine:
            raise WitnessUnavailableError(f"witness {name} answered no cosignature by its key")
        return mine[0]


def _parse_size(body: bytes, name: str) -> int:
    try:
        return parse_decimal(body.decode("ascii").removesuffix("\n"), "witness tree size")
    except (UnicodeDecodeError, AuditError):
        raise WitnessUnavailableError(f"witness {name} sent a 409 without a tree size") from None
