"""What each batch adapter merges, keeps apart, and how it splits answers back."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.batching import (
    KServeInfer,
    OpenAICompletions,
    OpenAIEmbeddings,
    TEIEmbed,
    TFServingPredict,
    adapter_for,
)
from gateway.batching.adapters import apportion
from gateway.errors import BatchSplitError


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/embeddings", OpenAIEmbeddings),
        ("/v1/completions", OpenAICompletions),
        ("/embed", TEIEmbed),
        ("/v2/models/resnet/infer", KServeInfer),
        ("/v2/models/resnet/versions/3/infer", KServeInfer),
        ("/v1/models/half_plus_two:predict", TFServingPredict),
        ("/v1/models/m/versions/2:predict", TFServingPredict),
    ],
)
def test_adapter_is_found_by_path(path, kind):
    assert isinstance(adapter_for(path), kind)


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/models/m:classify", "/v2/models/m/ready", "/"]
)
def test_paths_without_an_array_api_have_no_adapter(path):
    assert adapter_for(path) is None


def test_apportion_is_proportional_and_sums_exactly():
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(7, [2, 1, 1]) == [3, 2, 2]  # 3.5, 1.75, 1.75
    assert sum(apportion(1001, [3, 5, 7, 11])) == 1001
    assert apportion(0, [1, 2]) == [0, 0]


class TestOpenAIEmbeddings:
    adapter = OpenAIEmbeddings()

    @pytest.mark.parametrize(
        "value",
        ["a", ["a", "b"], [1, 2, 3], [[1, 2], [3]]],
        ids=["str", "strs", "tokens", "token-lists"],
    )
    def test_every_input_form_is_batchable(self, value):
        assert self.adapter.batchable({"model": "m", "input": value})

    @pytest.mark.parametrize("value", [[], None, 5, ["a", 1], [[1], "a"], [True]])
    def test_malformed_inputs_are_left_for_the_backend_to_reject_alone(self, value):
        assert not self.adapter.batchable({"model": "m", "input": value})

    def test_items_of_each_input_form(self):
        assert self.adapter.items({"input": "a"}) == ["a"]
        assert self.adapter.items({"input": [1, 2, 3]}) == [[1, 2, 3]]
        assert [
            self.adapter.count({"input": v}) for v in ("a", ["a", "b"], [1, 2], [[1], [2], [3]])
        ] == [1, 2, 1, 3]

    def test_compat_key_ignores_the_input_and_the_key_order_only(self):
        key = self.adapter.compat_key
        assert key({"model": "m", "input": "a", "dimensions": 8}) == key(
            {"dimensions": 8, "input": ["b", "c"], "model": "m"}
        )
        assert key({"model": "m", "input": "a"}) != key(
            {"model": "m", "input": "a", "dimensions": 8}
        )
        assert key({"model": "m", "input": "a"}) != key({"model": "m", "input": [1, 2]})

    def test_merge_concatenates_items_and_keeps_the_other_fields(self):
        merged = self.adapter.merge(
            [{"model": "m", "input": "a"}, {"model": "m", "input": ["b", "c"]}]
        )
        assert merged == {"model": "m", "input": ["a", "b", "c"]}

    def test_split_matches_by_index_renumbers_and_apportions_usage(self):
        response = {
            "object": "list",
            "model": "m",
            "data": [{"index": i, "embedding": [float(i)]} for i in (2, 0, 1)],
            "usage": {"prompt_tokens": 10, "total_tokens": 10},
        }
        one, two = self.adapter.split(200, response, [{"input": "a"}, {"input": ["b", "c"]}])
        assert one["data"] == [{"index": 0, "embedding": [0.0]}]
        assert two["data"] == [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [2.0]}]
        assert one["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
        assert two["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
        assert one["model"] == "m" and one["object"] == "list"

    @pytest.mark.parametrize(
        "data",
        [
            [{"index": 0, "embedding": []}],
            [{"index": 0}, {"index": 0}],
            [{"embedding": []}] * 2,
            None,
        ],
    )
    def test_answer_not_matching_the_inputs_cannot_be_split(self, data):
        with pytest.raises(BatchSplitError):
            self.adapter.split(200, {"data": data}, [{"input": "a"}, {"input": "b"}])


class TestOpenAICompletions:
    adapter = OpenAICompletions()

    @pytest.mark.parametrize(
        "fields",
        [{}, {"temperature": 0.7}, {"temperature": 0, "stream": True}, {"temperature": "0"}],
        ids=["default-temperature-samples", "sampled", "streamed", "malformed"],
    )
    def test_sampled_or_streamed_completions_are_not_merged(self, fields):
        assert not self.adapter.batchable({"model": "m", "prompt": "p", **fields})

    def test_greedy_completions_are_merged(self):
        assert self.adapter.batchable({"model": "m", "prompt": ["p", "q"], "temperature": 0})
        assert self.adapter.batchable({"model": "m", "prompt": [1, 2], "temperature": 0.0})

    def test_split_without_n_gives_one_choice_per_prompt(self):
        response = {
            "choices": [{"index": i, "text": str(i)} for i in range(3)],
            "usage": {"prompt_tokens": 3},
        }
        one, two = self.adapter.split(200, response, [{"prompt": ["a", "b"]}, {"prompt": "c"}])
        assert [c["text"] for c in one["choices"]] == ["0", "1"]
        assert two["choices"] == [{"index": 0, "text": "2"}]


class TestTEIEmbed:
    adapter = TEIEmbed()

    def test_other_fields_are_in_the_compat_key(self):
        key = self.adapter.compat_key
        assert key({"inputs": "a"}) == key({"inputs": ["b"]})
        assert key({"inputs": "a"}) != key({"inputs": "a", "normalize": False})

    def test_split_cuts_the_bare_list(self):
        assert self.adapter.split(
            200, [[1], [2], [3]], [{"inputs": ["a", "b"]}, {"inputs": "c"}]
        ) == [[[1], [2]], [[3]]]
        with pytest.raises(BatchSplitError):
            self.adapter.split(200, {"error": "x"}, [{"inputs": "a"}])


def tensor(
    name: str, shape: list[int], data: list[Any], datatype: str = "FP32", **extra: Any
) -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data, **extra}


class TestKServeInfer:
    adapter = KServeInfer()

    def test_requests_alike_in_names_datatypes_and_inner_dimensions_share_a_key(self):
        key = self.adapter.compat_key
        a = {"id": "1", "inputs": [tensor("x", [1, 2], [1, 2]), tensor("y", [1], [0], "INT64")]}
        b = {
            "id": "2",
            "inputs": [tensor("y", [3], [0, 1, 2], "INT64"), tensor("x", [3, 2], [[1, 2]] * 3)],
        }
        assert key(a) == key(b)
        assert key(a) != key(
            {"inputs": [tensor("x", [1, 3], [1, 2, 3]), tensor("y", [1], [0], "INT64")]}
        )
        assert key(a) != key(
            {"inputs": [tensor("x", [1, 2], [1, 2], "FP16"), tensor("y", [1], [0], "INT64")]}
        )
        assert key(a) != key({"inputs": [tensor("x", [1, 2], [1, 2])]})
        assert key(a) != key({**a, "outputs": [{"name": "probs"}]})

    @pytest.mark.parametrize(
        "body",
        [
            {"inputs": [tensor("x", [2, 2], [1, 2, 3])]},  # data does not fill the shape
            {"inputs": [tensor("x", [2], [1, 2]), tensor("y", [3], [1, 2, 3])]},  # rows disagree
            {"inputs": [tensor("x", [1], [1], parameters={"binary_data_size": 4})]},
            {
                "inputs": [tensor("x", [1], [1])],
                "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
            },
            {"inputs": []},
        ],
    )
    def test_requests_it_cannot_cut_by_rows_are_not_batchable(self, body):
        assert not self.adapter.batchable(body)

    def test_merge_concatenates_along_the_first_dimension(self):
        merged = self.adapter.merge(
            [
                {"id": "a", "inputs": [tensor("x", [1, 2], [[1, 2]])]},
                {"id": "b", "inputs": [tensor("x", [2, 2], [[3, 4], [5, 6]])]},
            ]
        )
        assert merged == {"inputs": [tensor("x", [3, 2], [[1, 2], [3, 4], [5, 6]])]}
        mixed = self.adapter.merge(
            [{"inputs": [tensor("x", [1, 2], [[1, 2]])]}, {"inputs": [tensor("x", [1, 2], [3, 4])]}]
        )
        assert mixed["inputs"][0]["data"] == [1, 2, 3, 4]

    def test_items_are_rows(self):
        body = {"inputs": [tensor("x", [2, 2], [1, 2, 3, 4]), tensor("y", [2], [7, 8])]}
        assert self.adapter.items(body) == [{"x": [1, 2], "y": [7]}, {"x": [3, 4], "y": [8]}]

    def test_split_cuts_every_output_and_echoes_each_id(self):
        bodies = [
            {"id": "a", "inputs": [tensor("x", [1], [0])]},
            {"inputs": [tensor("x", [2], [0, 0])]},
        ]
        response = {
            "model_name": "m",
            "id": "merged",
            "outputs": [
                tensor("p", [3, 2], [[1, 2], [3, 4], [5, 6]]),
                tensor("c", [3], [7, 8, 9], "INT64"),
            ],
        }
        a, b = self.adapter.split(200, response, bodies)
        assert a == {
            "model_name": "m",
            "id": "a",
            "outputs": [tensor("p", [1, 2], [[1, 2]]), tensor("c", [1], [7], "INT64")],
        }
        assert b["outputs"][0]["data"] == [[3, 4], [5, 6]] and "id" not in b

    def test_output_not_batched_along_the_first_dimension_cannot_be_split(self):
        bodies = [{"inputs": [tensor("x", [1], [0])]}] * 2
        with pytest.raises(BatchSplitError):
            self.adapter.split(200, {"outputs": [tensor("total", [1], [9])]}, bodies)


class TestTFServingPredict:
    adapter = TFServingPredict()

    def test_columnar_format_is_not_batchable(self):
        assert not self.adapter.batchable({"inputs": {"x": [[1, 2]]}})
        assert not self.adapter.batchable({"instances": []})

    def test_signature_and_instance_shape_are_in_the_compat_key(self):
        key = self.adapter.compat_key
        assert key({"instances": [[1, 2]]}) == key({"instances": [[3, 4], [5, 6]]})
        assert key({"instances": [[1, 2]]}) != key({"instances": [[1, 2, 3]]})
        assert key({"instances": [[1, 2]]}) != key({"signature_name": "s", "instances": [[1, 2]]})
        assert key({"instances": [{"a": 1}]}) != key({"instances": [{"b": 1}]})

    def test_ragged_instances_are_not_batchable(self):
        assert not self.adapter.batchable({"instances": [[1, 2], [1]]})

    def test_split_cuts_predictions(self):
        bodies = [{"instances": [1, 2]}, {"instances": [3]}]
        assert self.adapter.split(200, {"predictions": [10, 20, 30]}, bodies) == [
            {"predictions": [10, 20]},
            {"predictions": [30]},
        ]
