"""``POST /v1/feedback``: a rating of one completion, accepted once, from the key that got it
(the check is proxy/completions.py's). Written to ``ratchet.feedback`` as a FeedbackRecord whose
client is the one the rated answer was served to."""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.responses import Response

from proxy.completions import CompletionOwners
from proxy.errors import ProxyError
from proxy.messages_api import completion_id_of_message
from proxy.responses_api import completion_id_of_response
from proxy.state import ProxyState, read_json
from proxy.validation import check_feedback
from ratchet.records import FeedbackRecord


async def rate(state: ProxyState, owners: CompletionOwners, request: Request) -> Response:
    """``POST /v1/feedback``: a FeedbackRecord, once per completion, from its owner only."""
    key_hash = state.authenticate_client(request)
    payload, _ = await read_json(request, state.limits)
    completion_id, score, thumbs, comment = check_feedback(payload)
    # A Responses or a Messages id rates its logged answer.
    completion_id = completion_id_of_message(completion_id_of_response(completion_id))
    served_client = await owners.claim_rating(completion_id, key_hash)
    record = FeedbackRecord(
        completion_id=completion_id,
        score=score,
        thumbs=thumbs,
        comment=comment,
        api_key_hash=key_hash,
        # The client the rated answer was served to (a vouched user, noted with it), never the
        # rating body's `user`: a vouching app's user could otherwise rate as many clients.
        source=served_client or state.source(key_hash, {}),
    )
    if not state.traffic_log.submit(record, key=completion_id):
        owners.ratings.labels("queue_full").inc()
        await owners.release_rating(completion_id)
        raise ProxyError(
            503,
            "feedback queue is full; retry shortly",
            type="server_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    owners.ratings.labels("accepted").inc()
    accepted = {
        "object": "feedback",
        "completion_id": completion_id,
        "score": score,
        "status": "accepted",
    }
    return Response(orjson.dumps(accepted), media_type="application/json")
