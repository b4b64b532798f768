"""The embedding tier's verification: a reworded question frame, auxiliary agreement,
inflection, hedges, a missing possessive or a moved "is the best" pass; a changed content
word, number, negation, quote, direction, pronoun (also "how do you" for "how do I"), tense,
modal or word order never does."""

from __future__ import annotations

import pytest

from gateway.cache.embedding.verify import HOW_TO, HOW_TO_YOU, canonical, stem, verify
from gateway.cache.normalize import normalize

SAME = [
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the best way to learn Python?", "How do I learn Python?"),
    ("How can I improve my credit score?", "What are some ways to improve my credit score?"),
    ("Is there a way to recover deleted photos?", "How can I recover deleted photos?"),
    ("Which laptop is the best for gaming?", "What is the best laptop for gaming?"),
    ("How do I convert Celsius to Fahrenheit?", "How to convert Celsius to Fahrenheit?"),
    ("Can I eat eggs every day?", "Is it possible to eat eggs every day?"),
    ("How should I study for the SAT?", "What is the best way to study for the SAT?"),
    ("What should I do to improve my writing?", "How can I improve my writing?"),
    ("Which is the best book for learning C?", "What is the best book to learn C?"),
    ("How does a refrigerator work?", "How do refrigerators work?"),
    ("What is dark matter?", "What exactly is dark matter?"),
    ("Why am I so lazy?", "Why am I lazy?"),
    ("How do I clean my laptop screen?", "How do I clean the laptop screen?"),
    ("What does manipulation mean?", "What does manipulation means?"),
    ("How can I stop typing so slowly?", "How can I stop typing slowly?"),
    ("What is the capital of France?", "what is the capital of france"),  # the guard's own
]

DIFFERENT = [
    ("How do I reset my password?", "How do I reset his password?", "content"),
    ("How do I reset my password?", "How do I reset your password?", "pronoun"),
    ("How can I stop smoking?", "How can I start smoking?", "direction"),
    ("What caused the financial crisis?", "What causes the financial crisis?", "content"),
    ("Who is the president of the US?", "Who was the president of the US?", "content"),
    ("Who played in the final?", "Who plays in the final?", "content"),
    ("Is Java better than Python?", "Is Python better than Java?", "order"),
    ("Which is better, Python or Java?", "Which is worse, Python or Java?", "content"),
    ("What is the best way to lose weight?", "What is the worst way to lose weight?", "direction"),
    ("What is the fastest way to get to Paris?", "What is the cheapest way to get there?", ""),
    ("How do I get a job at Google?", "How did I get a job at Google?", "content"),
    ("How do I get a job at Google?", "How does he get a job at Google?", "content"),
    ("Can I take ibuprofen with alcohol?", "Should I take ibuprofen with alcohol?", "content"),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?", ""),
    ("How can I lose 10 pounds in a month?", "How can I lose 10 pounds in a week?", "content"),
    ("What should I do to be happy?", "What should I not do to be happy?", "negation"),
    ("How much is 5 kg in pounds?", "How much is 50 kg in pounds?", "numbers"),
    ('What does "carpe diem" mean?', 'What does "carpe noctem" mean?', "quoted"),
    ("How do I import a CSV into Excel?", "How do I export a CSV from Excel?", "direction"),
    ("How does a plane fly?", "How does a plan fly?", "content"),
    ("Why do teachers hate students?", "Why do students hate teachers?", "order"),
    ("How do I stop being jealous?", "Why am I jealous?", "content"),
    ("When was Google founded?", "Who founded Google?", "content"),
    ("What do cats eat?", "What eats cats?", "content"),
    ("Is it safe to drink tap water in Mexico?", "Is it safe to drink tap water in Canada?", ""),
    ("How do you feel today?", "How do I feel today?", "content"),
    ("Is the sale only today?", "Is the sale on today?", "content"),
    ("What is the news?", "What is new?", "content"),
]


@pytest.mark.parametrize(("first", "second"), SAME)
def test_rewordings_of_the_same_question_pass(first: str, second: str) -> None:
    assert verify(first, second).ok, (canonical(normalize(first)), canonical(normalize(second)))
    assert verify(second, first).ok


@pytest.mark.parametrize(("first", "second", "reason"), DIFFERENT)
def test_questions_that_ask_something_else_are_rejected(
    first: str, second: str, reason: str
) -> None:
    verdict = verify(first, second)
    assert not verdict.ok and not verify(second, first).ok
    if reason:
        assert verdict.reason == reason


def test_question_frames_canonicalise_to_one_token() -> None:
    for text in (
        "How do I learn Python?",
        "how can we learn python",
        "How to learn Python",
        "What is the best way to learn Python?",
        "What are some good ways to learn Python?",
        "What should I do to learn Python?",
        "Is there any way to learn Python?",
    ):
        assert canonical(normalize(text)) == (HOW_TO, "learn", "python"), text
    for text in ("How do you learn Python?", "how should you learn python"):
        assert canonical(normalize(text)) == (HOW_TO_YOU, "learn", "python"), text


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("typing", "type"),
        ("type", "type"),
        ("making", "make"),
        ("increasing", "increas"),
        ("increase", "increas"),
        ("studies", "study"),
        ("quickly", "quick"),
        ("swimming", "swim"),
        ("using", "use"),
        ("plane", "plane"),
        ("plan", "plan"),
        ("care", "care"),
        ("caused", "caused"),
        ("boxes", "box"),
        ("only", "only"),
        ("bully", "bully"),
        ("carefully", "careful"),
        ("news", "news"),
        ("physics", "physics"),
        ("C++", "C++"),
    ],
)
def test_stem(word: str, expected: str) -> None:
    assert stem(word) == expected
