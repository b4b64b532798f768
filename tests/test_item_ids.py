"""Items bound to the tenant whose response or conversation holds them
(``tenants.response_id_secret``): a server resolves an item named by its id (an
``item_reference`` in a response's input, an input item given with its ``id``) whoever made
it, so the gateway tags every item of an answer whose response or list the caller owns, and
checks and untags every item id a request gives: in its input, its conversation's items, the
path of one item, a list's cursor.  Another tenant's item is a 404 before any backend.  The
official ``openai`` SDK as the client, the model server of ``tests.test_response_ids`` on a
real socket (it keeps every item under its id, as OpenAI does)."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import openai
import pytest

from gateway.openai.bound_ids import (
    CONVERSATION,
    FEW_OWNED,
    ITEM,
    RESPONSE,
    Owned,
    ResponseIds,
)
from gateway.sim import SimConfig, start_sim
from tests.helpers import metric, write_policy
from tests.test_response_ids import ALICE, BOB, SECRET, Store, policy, round_robin, sdk


def reference(iid: str) -> Any:
    return {"type": "item_reference", "id": iid}


def id_of(item: Any) -> str:
    """An item's id (the SDK's types allow none)."""
    assert isinstance(item.id, str)
    return item.id


async def test_a_tenant_names_its_own_items_and_the_server_gets_them_untagged(bound):
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        first = await alice.responses.create(model="m", input="hi")
        item = id_of(first.output[0])
        assert item.startswith("msg_0001~") and item.count("~") == 2
        assert (await alice.responses.retrieve(first.id)).output[0].id == item
        again = await alice.responses.create(model="m", input=[reference(item)])
        passed_back: list[Any] = [each.model_dump(exclude_none=True) for each in first.output]
        more: list[Any] = [{"role": "user", "content": "and?"}]
        chained = await alice.responses.create(model="m", input=passed_back + more)
        inputs = await alice.responses.input_items.list(chained.id)
        assert inputs.data[0].id == item  # the item given, tagged again
        assert id_of(inputs.data[1]).startswith("item_")  # the one the server named, tagged
        assert "~" in id_of(inputs.data[1])
    assert store.asked[2][2]["input"] == [reference("msg_0001")]
    assert store.asked[3][2]["input"][0]["id"] == "msg_0001"
    assert id_of(again.output[0]).startswith("msg_0002~")


async def test_another_tenant_is_refused_every_item_it_did_not_get_and_the_backend_never_asked(
    bound,
):
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = await alice.responses.create(model="m", input="secret plans")
    item = id_of(made.output[0])
    raw = item.partition("~")[0]
    forged = raw + "~" + "0" * 24
    asked = len(store.asked)
    async with sdk(gw, BOB) as bob:
        own = (await bob.conversations.create()).id
        for iid in (item, raw, forged):
            with pytest.raises(openai.NotFoundError) as refused:
                await bob.responses.create(model="m", input=[reference(iid)])
            assert refused.value.code == "item_not_found"
            given: Any = {"type": "message", "id": iid, "role": "user", "content": "hi"}
            with pytest.raises(openai.NotFoundError):
                await bob.responses.create(model="m", input=[given])
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.items.create(own, items=[reference(iid)])
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.items.retrieve(iid, conversation_id=own)
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.items.list(own, after=iid)
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.create(items=[reference(iid)])
    assert len(store.asked) == asked + 1  # only bob's own conversation reached the server
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.admin_url + "/metrics")).text
    counter = "gateway_response_ids_refused_total"
    assert metric(text, counter, tenant="", where="item") == 3 * 5
    assert metric(text, counter, tenant="", where="path") == 3


async def test_ten_thousand_items_given_by_id_are_each_untagged(bound):
    """A body naming an item ten thousand times (more than ``YIELD_EVERY``, the loop runs
    between them): every one reaches the server untagged."""
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        item = id_of((await alice.responses.create(model="m", input="hi")).output[0])
    body = {"model": "m", "input": [reference(item)] * 10_000}  # the SDK's checks take 10 s
    async with httpx.AsyncClient() as client:
        alice_h = {"Authorization": f"Bearer {ALICE}"}
        answer = await client.post(gw.url + "/v1/responses", json=body, headers=alice_h)
    assert answer.status_code == 200
    assert store.asked[-1][2]["input"] == [reference("msg_0001")] * 10_000


async def test_a_conversations_items_are_tagged_and_read_back_by_their_tags(bound):
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = await alice.conversations.create(items=[{"role": "user", "content": "hello"}])
        await alice.responses.create(model="m", input="more", conversation=made.id)
        listed = await alice.conversations.items.list(made.id)
        ids = [id_of(each) for each in listed.data]
        assert len(ids) == 3 and all(iid.count("~") == 2 for iid in ids)
        assert listed.last_id == ids[-1]  # and first_id, which the SDK does not show
        assert listed.model_extra is not None and listed.model_extra["first_id"] == ids[0]
        later = await alice.conversations.items.list(made.id, after=ids[0])
        assert [each.id for each in later.data] == ids[1:]
        for iid in ids:
            assert (
                await alice.conversations.items.retrieve(iid, conversation_id=made.id)
            ).id == iid
        other = await alice.conversations.create()
        await alice.conversations.items.create(other.id, items=[reference(ids[2])])
        copied = await alice.conversations.items.list(other.id)
        assert [each.id for each in copied.data] == [ids[2]]
    raw = [iid.partition("~")[0] for iid in ids]
    conversation = made.id.partition("~")[0]
    assert store.asked[3][1] == f"/v1/conversations/{conversation}/items?after={raw[0]}"
    assert store.asked[4][1] == f"/v1/conversations/{conversation}/items/{raw[0]}"
    assert store.asked[-2][2]["items"] == [reference(raw[2])]
    async with httpx.AsyncClient() as client:  # a cursor's name spelled otherwise
        bob = {"Authorization": f"Bearer {BOB}"}
        own = (await client.post(gw.url + "/v1/conversations", json={}, headers=bob)).json()
        spelled = f"{gw.url}/v1/conversations/{own['id']}/items?limit=2&aft%65r={raw[0]}"
        assert (await client.get(spelled, headers=bob)).status_code == 404


async def test_a_streamed_answers_items_are_tagged_in_every_event(bound):
    """The item's id is learned from the event that adds it: the deltas that name it
    (``item_id``) and the completed response carry the same tagged id."""
    _, gw = bound
    events = []
    async with sdk(gw, ALICE) as alice:
        stream = await alice.responses.create(model="m", input="hi", stream=True)
        async for event in stream:
            events.append(event)
    added = next(e for e in events if e.type == "response.output_item.added")
    delta = next(e for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.completed")
    assert id_of(added.item).startswith("msg_0001~")
    assert delta.item_id == added.item.id == done.response.output[0].id


PATHS = ("/v1/responses", "/v1/conversations")


async def test_the_collections_are_not_listed(bound):
    store, gw = bound
    alice = {"Authorization": f"Bearer {ALICE}"}
    async with httpx.AsyncClient() as client:
        for path in PATHS:
            reply = await client.get(gw.url + path, headers=alice)
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
            preflight = await client.options(gw.url + path, headers=alice)
            assert preflight.status_code == 405  # the server's own answer: passed on
    assert not store.asked


async def test_bodies_the_edge_does_not_read_are_checked_compressed_or_not(bound):
    """A token count (``/v1/responses/input_tokens``) and a conversation's items are read
    here: a gzip body is decoded and checked, and what goes upstream is the untagged JSON."""
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = await alice.responses.create(model="m", input="hi")
    item, rid = id_of(made.output[0]), made.id
    async with httpx.AsyncClient() as client:
        alice_h = {"Authorization": f"Bearer {ALICE}"}
        bob_h = {"Authorization": f"Bearer {BOB}"}
        count = {"model": "m", "input": "x", "previous_response_id": rid}
        url = gw.url + "/v1/responses/input_tokens"
        assert (await client.post(url, json=count, headers=bob_h)).status_code == 400
        assert (await client.post(url, json=count, headers=alice_h)).status_code == 200
        body = gzip.compress(json.dumps({"items": [reference(item)]}).encode())
        zipped = {**alice_h, "Content-Encoding": "gzip", "Content-Type": "application/json"}
        made_conv = await client.post(gw.url + "/v1/conversations", content=body, headers=zipped)
        assert made_conv.status_code == 200
        zipped_bob = {**zipped, **bob_h}
        refused = await client.post(gw.url + "/v1/conversations", content=body, headers=zipped_bob)
        assert refused.status_code == 404
        broken = await client.post(gw.url + "/v1/conversations", content=b"[1]", headers=alice_h)
        assert broken.status_code == 400
    assert store.asked[-1][2] == {"items": [reference("msg_0001")]}
    assert store.asked[-2][2]["previous_response_id"] == "resp_0001"


async def test_an_item_is_asked_of_the_instance_that_keeps_it(serve_app, start_gateway, tmp_path):
    """Two instances behind round robin, naming their items alike: a reference to an item
    goes to the instance that keeps it."""
    stores = [Store("a: "), Store("b: ")]
    urls = [await serve_app(store.app()) for store in stores]
    gw = await start_gateway(policy=write_policy(tmp_path, round_robin(urls)))
    async with sdk(gw, ALICE) as alice:
        made = [await alice.responses.create(model="m", input="hi") for _ in range(2)]
        items = [id_of(answer.output[0]) for answer in made]
        assert items[0].partition("~")[0] == items[1].partition("~")[0] == "msg_0001"
        assert {answer.output_text[:3] for answer in made} == {"a: ", "b: "}
        for _ in range(2):
            for at, item in enumerate(items):
                again = await alice.responses.create(model="m", input=[reference(item)])
                assert again.output_text[:3] == made[at].output_text[:3]


async def test_a_list_too_large_to_come_whole_is_read_whole_and_every_item_tagged(bound):
    """A conversation's items past the transport's whole-answer buffer (1 MiB) come as a
    stream: it is read whole (up to ``server.max_body_bytes``), and each item's id, and the
    list's cursors, are tagged as in a small one."""
    _, gw = bound
    big = "word " * 20_000  # 100 kB an item
    async with sdk(gw, ALICE) as alice:
        made = await alice.conversations.create()
        for _ in range(2):
            items: list[Any] = [{"role": "user", "content": big} for _ in range(10)]
            await alice.conversations.items.create(made.id, items=items)
        listed = await alice.conversations.items.list(made.id)
        ids = [id_of(each) for each in listed.data]
        assert len(ids) == 20 and all(iid.count("~") == 2 for iid in ids)
        assert listed.last_id == ids[-1]
        last = await alice.conversations.items.retrieve(ids[-1], conversation_id=made.id)
        assert id_of(last) == ids[-1]


def test_many_ids_are_tagged_in_one_pass_as_one_by_one():
    """Past ``FEW_OWNED`` ids in one body, the ids are tagged in one pass over it, with the
    same result: never inside another string, never an id the caller does not own, nor
    after a stray quote in a stream's comment."""
    ids = ResponseIds(SECRET)
    owned = [Owned(f"msg_{n}", "0a1b2c3d", ITEM) for n in range(FEW_OWNED + 4)]
    items = [
        {"id": f"msg_{n}", "text": f'see "msg_{n}" and \\"msg_{n}\\"', "other": f"msg_{n + 50}"}
        for n in range(40)
    ]
    body = json.dumps({"object": "list", "data": items}).encode()
    one_pass = ids.tag_owned("scope", body, owned)
    one_by_one = body
    for each in owned:
        one_by_one = ids.tag_owned("scope", one_by_one, [each])
    assert one_pass == one_by_one != body
    tagged = json.loads(one_pass)["data"]
    assert all(item["id"].count("~") == 2 for item in tagged[: len(owned)])
    assert [item["id"] for item in tagged[len(owned) :]] == [i["id"] for i in items[len(owned) :]]
    assert [item["text"] for item in tagged] == [item["text"] for item in items]
    event = b': a "stray quote\ndata: ' + json.dumps({"item_id": "msg_1"}).encode() + b"\n\n"
    assert ids.tag_owned("scope", event, owned).count(b"~") == 2


def test_an_item_id_untags_only_as_an_item():
    ids = ResponseIds(SECRET)
    item = ids.tag("scope", "resp_1", "0a1b2c3d", ITEM)  # an item named like a response
    assert ids.untag("scope", item, ITEM) == Owned("resp_1", "0a1b2c3d", ITEM)
    assert ids.untag("scope", item) is None and ids.untag("scope", item, CONVERSATION) is None
    response = ids.tag("scope", "resp_1", "0a1b2c3d", RESPONSE)
    assert response != item and ids.untag("scope", response, ITEM) is None
    assert ids.untag("other", item, ITEM) is None
    unpinned = ids.tag("scope", "msg_1", "", ITEM)
    assert ids.untag("scope", unpinned, ITEM) == Owned("msg_1", "", ITEM)


async def test_a_stream_naming_its_item_only_in_deltas_is_tagged_alike(start_gateway, tmp_path):
    """``gateway sim`` names its answer's item first in the deltas (``item_id``), with no
    ``response.output_item.added`` before them: the id is learned there, and every event
    carries it tagged alike."""
    sim = await start_sim(SimConfig(port=0, base_ms=0, token_ms=0, answer_tokens=3))
    try:
        gw = await start_gateway(policy=write_policy(tmp_path, policy(sim.url)))
        async with sdk(gw, ALICE) as alice:
            stream = await alice.responses.create(model="m", input="hi", stream=True)
            events: list[Any] = [event async for event in stream]
    finally:
        await sim.close()
    named = {getattr(e, "item_id", None) for e in events if hasattr(e, "item_id")}
    completed = next(e for e in events if e.type == "response.completed")
    named.add(id_of(completed.response.output[0]))
    assert len(named) == 1 and str(next(iter(named))).count("~") == 2


@pytest.mark.llm
async def test_llama_cpps_items_are_tagged_and_passed_back_through_a_binding_gateway(
    llama, start_gateway, tmp_path
):
    """llama.cpp's server stores nothing but names each output item: through a gateway
    binding ids, a client gets those names tagged, alike in every event of a stream, and
    passes a response's output back as input (state kept by the client), untagged on its
    way to the server, which answers it."""
    gw = await start_gateway(policy=write_policy(tmp_path, policy(llama.url)))
    async with sdk(gw, ALICE) as alice:
        first = await alice.responses.create(
            model="gemma", input="Count to three", max_output_tokens=6
        )
        passed_back: list[Any] = [each.model_dump(exclude_none=True) for each in first.output]
        asked: list[Any] = [{"role": "user", "content": "Count to three"}]
        more: list[Any] = [{"role": "user", "content": "And four?"}]
        stream = await alice.responses.create(
            model="gemma", input=asked + passed_back + more, max_output_tokens=6, stream=True
        )
        events: list[Any] = [event async for event in stream]
        named = {getattr(e, "item_id", None) or id_of(e.item) for e in events if _names_item(e)}
        async with sdk(gw, BOB) as bob:
            with pytest.raises(openai.NotFoundError):
                await bob.responses.create(model="gemma", input=passed_back + more)
    item = id_of(first.output[0])
    assert item.startswith("msg_") and item.count("~") == 2
    assert len(named) == 1 and next(iter(named)).count("~") == 2


def _names_item(event: Any) -> bool:
    return hasattr(event, "item") or hasattr(event, "item_id")
