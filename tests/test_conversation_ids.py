"""The Conversations API's conversations, scoped to the tenant that made them
(``tenants.response_id_secret``, as stored responses are): a conversation's id reaches its
maker tagged for its credentials and its instance; the conversation's paths, its items, and
a response's ``conversation`` are checked, untagged and pinned; another tenant's id is a 404
before any backend.  The official ``openai`` SDK as the client, a model server on a real
socket that keeps conversations as the Conversations API does."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from gateway.openai.bound_ids import CONVERSATION, ResponseIds
from gateway.sim import SimConfig, start_sim
from tests.helpers import metric, write_policy
from tests.test_response_ids import ALICE, BOB, SECRET, Store, held_policy, round_robin, sdk


def said(text: str) -> list[Any]:
    return [{"type": "message", "role": "user", "content": text}]


async def test_a_tenant_keeps_its_conversation_and_answers_join_it(bound):
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = await alice.conversations.create(items=said("hello"))
        assert made.id.startswith("conv_0001~") and made.id.count("~") == 2
        assert (await alice.conversations.retrieve(made.id)).id == made.id
        await alice.conversations.items.create(made.id, items=said("more"))
        answer = await alice.responses.create(model="m", input="and?", conversation=made.id)
        assert answer.conversation is not None and answer.conversation.id == made.id
        wrapped = await alice.responses.create(model="m", input="x", conversation={"id": made.id})
        assert wrapped.conversation is not None and wrapped.conversation.id == made.id
        items = await alice.conversations.items.list(made.id)
        assert len(items.data) == 6  # hello, more, and two turns
        shown = items.data[3].id  # the first answer's, tagged for alice
        assert shown is not None and shown.startswith("msg_0002~")
        item = await alice.conversations.items.retrieve(shown, conversation_id=made.id)
        assert item.id == shown
        updated = await alice.conversations.update(made.id, metadata={"topic": "t"})
        assert updated.id == made.id
        deleted = await alice.conversations.delete(made.id)
        assert deleted.id == made.id and deleted.deleted
    raw = "conv_0001"
    assert [asked[:2] for asked in store.asked] == [
        ("POST", "/v1/conversations"),
        ("GET", f"/v1/conversations/{raw}"),
        ("POST", f"/v1/conversations/{raw}/items"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/responses"),
        ("GET", f"/v1/conversations/{raw}/items"),
        ("GET", f"/v1/conversations/{raw}/items/msg_0002"),
        ("POST", f"/v1/conversations/{raw}"),
        ("DELETE", f"/v1/conversations/{raw}"),
    ]
    assert store.asked[3][2]["conversation"] == raw
    assert store.asked[4][2]["conversation"] == {"id": raw}


async def test_another_tenant_is_refused_every_conversation_it_did_not_make(bound):
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = (await alice.conversations.create(items=said("secret plans"))).id
    asked = len(store.asked)
    raw = made.partition("~")[0]
    forged = raw + "~" + "0" * 24
    async with sdk(gw, BOB) as bob:
        for cid in (made, raw, forged):
            with pytest.raises(openai.NotFoundError) as refused:
                await bob.conversations.retrieve(cid)
            assert refused.value.code == "conversation_not_found"
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.update(cid, metadata={"a": "b"})
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.delete(cid)
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.items.list(cid)
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.items.create(cid, items=said("injected"))
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.items.retrieve("msg_1", conversation_id=cid)
            with pytest.raises(openai.NotFoundError) as continued:
                await bob.responses.create(model="m", input="x", conversation=cid)
            assert continued.value.code == "conversation_not_found"
            with pytest.raises(openai.NotFoundError):
                await bob.responses.create(model="m", input="x", conversation={"id": cid})
    assert len(store.asked) == asked
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.admin_url + "/metrics")).text
    counter = "gateway_response_ids_refused_total"
    assert metric(text, counter, tenant="", where="path") == 3 * 6
    assert metric(text, counter, tenant="", where="conversation") == 3 * 2


async def test_a_response_id_is_no_conversation_id_nor_the_other_way_round(bound):
    """The two kinds share the secret, but the tag covers the id's prefix: a tenant's own
    response id is not accepted where a conversation's is expected, nor the reverse (a
    conversation's id in a response's path is no response id, and passes to the server,
    which has no such response)."""
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        conversation = (await alice.conversations.create()).id
        response = (await alice.responses.create(model="m", input="hi")).id
        asked = len(store.asked)
        with pytest.raises(openai.NotFoundError):
            await alice.conversations.retrieve(response)
        with pytest.raises(openai.NotFoundError):
            await alice.responses.create(model="m", input="x", conversation=response)
        with pytest.raises(openai.BadRequestError):
            await alice.responses.create(model="m", input="x", previous_response_id=conversation)
        assert len(store.asked) == asked
        with pytest.raises(openai.NotFoundError):
            await alice.responses.retrieve(conversation)


async def test_no_path_below_conversations_passes_without_an_id_of_its_own(bound):
    """Every path below ``/v1/conversations/`` names a conversation: whatever stands there,
    spelled however, is checked, and anything but the caller's own id is refused."""
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = (await alice.conversations.create()).id
    raw = made.partition("~")[0]
    asked = len(store.asked)
    bob = {"Authorization": f"Bearer {BOB}"}
    async with httpx.AsyncClient() as client:
        for path in (
            raw.replace("_", "%5F"),
            raw.replace("c", "%63", 1),
            raw + "/",
            raw + "/items/",
            "x/../" + raw,
            made.replace("~", "%7E"),
            "",
            "anything",
        ):
            reply = await client.get(gw.url + "/v1/conversations/" + path, headers=bob)
            assert reply.status_code in (400, 404), (path, reply.status_code)
    assert len(store.asked) == asked


def test_a_conversation_id_untags_only_as_a_conversation():
    ids = ResponseIds(SECRET)
    tagged = ids.tag("scope", "conv_1", "0a1b2c3d")
    assert ids.untag("scope", tagged, CONVERSATION) == ("conv_1", "0a1b2c3d", CONVERSATION)
    assert ids.untag("scope", tagged) is None  # not a response's
    assert ids.untag("other", tagged, CONVERSATION) is None


async def test_a_conversation_is_asked_of_the_instance_that_keeps_it(
    serve_app, start_gateway, tmp_path
):
    """Two instances behind round robin, each keeping its own conversations (and naming
    them alike): every read, item and answer of a conversation reaches the one that keeps
    it."""
    stores = [Store("a: "), Store("b: ")]
    urls = [await serve_app(store.app()) for store in stores]
    text = round_robin(urls)
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    async with sdk(gw, ALICE) as alice:
        made = [await alice.conversations.create() for _ in range(4)]
        assert len({m.id for m in made}) == 4  # conv_0001 twice, on two instances
        for conversation in made:
            for turn in range(3):
                answer = await alice.responses.create(
                    model="m", input=f"turn {turn}", conversation=conversation.id
                )
                assert answer.conversation is not None
                assert answer.conversation.id == conversation.id
            items = await alice.conversations.items.list(conversation.id)
            assert len(items.data) == 6
    assert sorted(len(items) for s in stores for items in s.conversations.values()) == [6] * 4


@pytest.mark.parametrize("bound", [True, False])
async def test_a_tenant_held_to_some_models_keeps_conversations_once_ids_are_bound(
    serve_app, start_gateway, tmp_path, bound
):
    """A conversation names no model: a tenant held to some models may keep its own once
    ids are bound to it, and is refused the paths (a 403) without the secret."""
    store = Store()
    url = await serve_app(store.app())
    gw = await start_gateway(policy=write_policy(tmp_path, held_policy(url, bound=bound)))
    async with sdk(gw, ALICE) as alice:
        if not bound:
            with pytest.raises(openai.PermissionDeniedError):
                await alice.conversations.create()
            return
        made = await alice.conversations.create()
        await alice.conversations.items.create(made.id, items=said("hi"))
        answer = await alice.responses.create(model="m", input="x", conversation=made.id)
        assert answer.conversation is not None and answer.conversation.id == made.id
        with pytest.raises(openai.NotFoundError):
            await alice.responses.create(model="other", input="x", conversation=made.id)
        await alice.conversations.delete(made.id)
    assert not store.conversations


async def test_gateway_sims_conversations_are_kept_on_their_own_instance(start_gateway, tmp_path):
    """Two ``gateway sim``s behind round robin, each keeping its own conversations: every
    turn of a conversation, its items and its deletion reach the instance that keeps it,
    and its input grows turn after turn; another tenant is refused it."""
    sims = [await start_sim(SimConfig(port=0, base_ms=0, token_ms=0)) for _ in range(2)]
    try:
        text = round_robin([s.url for s in sims])
        gw = await start_gateway(policy=write_policy(tmp_path, text))
        async with sdk(gw, ALICE) as alice:
            made = [await alice.conversations.create(items=said("hello")) for _ in range(2)]
            for conversation in made:
                before = 0
                for _ in range(3):
                    turn = await alice.responses.create(
                        model="m", input="and then?", conversation=conversation.id
                    )
                    assert turn.usage is not None and turn.usage.input_tokens > before
                    before = turn.usage.input_tokens
                listed = await alice.conversations.items.list(conversation.id)
                assert len(listed.data) == 7
            async with sdk(gw, BOB) as bob:
                with pytest.raises(openai.NotFoundError):
                    await bob.conversations.items.list(made[0].id)
            for conversation in made:
                await alice.conversations.delete(conversation.id)
                with pytest.raises(openai.NotFoundError):
                    await alice.conversations.retrieve(conversation.id)
    finally:
        for s in sims:
            await s.close()
