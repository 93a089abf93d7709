"""A seeded generator of short English-like stories, used to pretrain the offline tiny policy.

The grammar is small but mixes positive, negative and neutral sentences with optional
descriptive adjectives, so a reward model can later learn sentiment and descriptiveness from
text the policy is able to write. Every function takes its own `random.Random`; the same seed
always gives the same text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MOODS = ("positive", "negative", "neutral")

# --- lexicon --------------------------------------------------------------------------------

NAMES_SHE = ("Anna", "Mira", "Lucy", "Emma", "Rosa", "Nora", "Lily", "Sara", "Maya", "Ella",
             "Clara", "Ruth", "Jane", "Alice", "Grace", "Hannah")
NAMES_HE = ("Tom", "Sam", "Leo", "Ben", "Jack", "Oscar", "Max", "Noah", "Finn", "Hugo",
            "Peter", "Paul", "David", "Owen", "Henry", "Victor")
PEOPLE_SHE = ("the old woman", "the young girl", "the teacher", "the farmer's wife", "his sister",
              "the little girl", "the nurse", "her grandmother", "the queen", "the baker's daughter")
PEOPLE_HE = ("the old man", "the young boy", "the farmer", "the doctor", "her brother",
             "the little boy", "the fisherman", "his grandfather", "the king", "the baker")
PEOPLE_THEY = ("the children", "the two friends", "the travelers", "the villagers", "the students",
               "the neighbors", "the sailors", "the twins")
COMPANIONS = ("her friend", "his friend", "the dog", "the cat", "a stranger", "the teacher",
              "her mother", "his father", "the children", "an old friend", "the neighbors",
              "the baker", "the girl next door", "his little brother", "her aunt")
PLACES = ("the market", "the river", "the old house", "the forest", "the village", "the school",
          "the kitchen", "the garden", "the station", "the beach", "the hill", "the library",
          "the farm", "the church", "the bridge", "the harbor", "the park", "the city",
          "the lake", "the mountain", "the field", "the shop", "the castle", "the road")
TIMES = ("in the morning", "that evening", "after dinner", "at night", "on Sunday",
         "one summer day", "before sunrise", "in the afternoon", "the next day", "last winter",
         "at noon", "that spring", "after school", "on a rainy day", "at dawn")
THINGS = ("box", "letter", "book", "cup", "basket", "key", "lamp", "map", "coat", "hat",
          "bottle", "ring", "stone", "picture", "bag", "clock", "chair", "door", "window",
          "boat", "bicycle", "blanket", "bread", "apple", "flower", "candle", "bell", "rope",
          "kite", "violin", "garden gate", "wooden spoon", "bucket", "scarf", "mirror")
SURFACES = ("table", "floor", "shelf", "bed", "bench", "grass", "desk", "wall", "stairs", "roof")
ANIMALS = ("dog", "cat", "horse", "bird", "fox", "cow", "goat", "rabbit", "owl", "duck")
FOODS = ("soup", "cake", "bread", "pie", "apples", "fish", "tea", "cookies", "berries", "rice")
DAY_WORDS = ("day", "morning", "evening", "night", "afternoon", "week", "summer", "winter")

# Descriptive adjectives: sentiment-neutral, they only add detail (descriptiveness task).
DESCRIPTIVE = ("old", "small", "tall", "red", "green", "blue", "wooden", "quiet", "dusty",
               "narrow", "golden", "shiny", "soft", "heavy", "round", "tiny", "wide", "long",
               "yellow", "white", "black", "brown", "silver", "empty", "wet", "deep", "thin",
               "huge", "ancient", "little", "crooked", "striped", "stone", "painted", "rusty")
DESCRIPTIVE_PARTS = ("a red ribbon", "a broken handle", "a long crack", "a silver lid",
                     "tiny blue flowers on it", "a wooden frame", "a golden edge", "a torn corner",
                     "a small hole", "white stripes", "a brass clasp", "a faded label")

# Sentiment words that VADER scores strongly.
POS_FEELINGS = ("happy", "glad", "proud", "grateful", "excited", "cheerful", "joyful",
                "delighted", "hopeful", "lucky", "calm", "peaceful", "safe", "comfortable")
NEG_FEELINGS = ("sad", "angry", "lonely", "miserable", "upset", "scared", "hurt", "tired",
                "worried", "nervous", "ashamed", "bitter", "hopeless", "sick")
POS_ADJECTIVES = ("wonderful", "beautiful", "lovely", "perfect", "great", "amazing", "nice",
                  "bright", "sweet", "kind", "gentle", "fantastic", "brilliant", "friendly",
                  "pleasant", "glorious", "excellent", "delicious", "fresh", "warm")
NEG_ADJECTIVES = ("terrible", "awful", "horrible", "bad", "dreadful", "ugly", "cruel", "nasty",
                  "rotten", "painful", "dirty", "boring", "dull", "grim", "broken", "gloomy")
POS_VERBS = ("loved", "enjoyed", "liked", "admired", "adored", "treasured")
NEG_VERBS = ("hated", "feared", "disliked", "missed", "lost", "broke")
POS_ACTIONS = ("smiled", "laughed", "sang a happy song", "danced with joy", "cheered",
               "hugged everyone", "felt better", "laughed out loud")
NEG_ACTIONS = ("cried", "screamed", "shouted in anger", "wept", "sighed sadly", "felt worse",
               "sobbed", "trembled with fear")
NEUTRAL_ACTIONS = ("waited", "sat down", "looked around", "stood still", "walked on",
                   "went home", "listened", "nodded", "turned around", "counted to ten")
POS_EVENTS = ("won the prize", "found a lost puppy", "got a kind letter", "made a new friend",
              "passed the test", "saw a beautiful rainbow", "received a lovely gift",
              "celebrated with the whole village", "helped a friend", "finished the work")
NEG_EVENTS = ("lost the money", "failed the test", "broke a leg", "missed the last train",
              "had a terrible fight", "got very sick", "was hurt in the storm",
              "lost the way home", "was blamed for the mistake", "heard the awful news")
POS_QUOTES = ("I love this place", "what a wonderful day", "this is great", "thank you so much",
              "you are very kind", "we did it", "I am so happy", "this is perfect")
NEG_QUOTES = ("I hate this place", "what a terrible day", "this is awful", "leave me alone",
              "I am so tired", "everything is wrong", "I am afraid", "this is a disaster")
NEUTRAL_QUOTES = ("where are we going", "it is getting late", "let us go to the river",
                  "the bus leaves at noon", "put the box on the table", "I will be back soon",
                  "we need more bread", "the door is open")
ANIMAL_POS = ("seemed happy", "wagged its tail happily", "looked content", "played joyfully")
ANIMAL_NEG = ("seemed sad", "looked scared", "was hurt", "ran away in fear")
OPENERS = ("Once upon a time", "One day", "Long ago", "Early that morning", "Last summer",
           "Every Sunday", "Years later", "That night", "In a small town", "One cold morning")


@dataclass(frozen=True)
class Character:
    """Who a paragraph is about, and the pronouns to refer back to them."""

    name: str
    subject: str  # he / she / they
    object: str  # him / her / them
    possessive: str  # his / her / their
    plural: bool


# --- helpers -----------------------------------------------------------------------------------


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def _a_or_an(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _with_article(phrase: str) -> str:
    return f"{_a_or_an(phrase)} {phrase}"


def _adjectives(rng: random.Random, mood: str, max_count: int = 2) -> list[str]:
    """0-2 adjectives: descriptive ones, plus a sentiment one matching the mood now and then."""
    count = min(rng.choice((0, 0, 1, 1, 1, 2)), max_count)
    words = rng.sample(DESCRIPTIVE, count)
    if mood == "positive" and rng.random() < 0.3:
        words.insert(0, rng.choice(POS_ADJECTIVES))
    elif mood == "negative" and rng.random() < 0.3:
        words.insert(0, rng.choice(NEG_ADJECTIVES))
    return words


def _noun_phrase(rng: random.Random, noun: str, mood: str, article: str = "the",
                 with_detail: bool = True) -> str:
    words = _adjectives(rng, mood) + [noun]
    phrase = " ".join(words)
    if article == "a":
        article = _a_or_an(phrase)
    detail = f" with {rng.choice(DESCRIPTIVE_PARTS)}" if with_detail and rng.random() < 0.12 else ""
    return f"{article} {phrase}{detail}"


def _place(rng: random.Random, mood: str) -> str:
    place = rng.choice(PLACES)
    if rng.random() < 0.3:
        noun = place.split(" ", 1)[1]
        return _noun_phrase(rng, noun, mood, with_detail=False)
    return place


def _new_character(rng: random.Random) -> Character:
    kind = rng.random()
    if kind < 0.35:
        return Character(rng.choice(NAMES_SHE), "she", "her", "her", False)
    if kind < 0.7:
        return Character(rng.choice(NAMES_HE), "he", "him", "his", False)
    if kind < 0.82:
        return Character(rng.choice(PEOPLE_SHE), "she", "her", "her", False)
    if kind < 0.94:
        return Character(rng.choice(PEOPLE_HE), "he", "him", "his", False)
    return Character(rng.choice(PEOPLE_THEY), "they", "them", "their", True)


def _be(who: Character) -> str:
    return "were" if who.plural else "was"


# --- sentences ---------------------------------------------------------------------------------


def _neutral_clause(rng: random.Random, who: str, me: Character, mood: str) -> str:
    thing = _noun_phrase(rng, rng.choice(THINGS), mood)
    choices = (
        lambda: f"{who} walked to {_place(rng, mood)} {rng.choice(TIMES)}",
        lambda: f"{who} opened {thing} and looked inside",
        lambda: f"{who} sat by the {rng.choice(('window', 'fire', 'door', 'river'))} and waited",
        lambda: f"{who} picked up {thing} from the {rng.choice(SURFACES)}",
        lambda: f"{who} went to {_place(rng, mood)} with {rng.choice(COMPANIONS)}",
        lambda: f"{who} told {rng.choice(COMPANIONS)} about {thing}",
        lambda: f"{who} {rng.choice(NEUTRAL_ACTIONS)}",
        lambda: f"{who} carried {thing} to {_place(rng, mood)}",
        lambda: f"{who} saw {_noun_phrase(rng, rng.choice(ANIMALS), mood, 'a')} near {_place(rng, mood)}",
        lambda: f"{who} cooked {rng.choice(FOODS)} for {rng.choice(COMPANIONS)}",
        lambda: f"{who} wrote a letter to {rng.choice(COMPANIONS)}",
        lambda: f"{who} looked at {thing} for a long time",
        lambda: f"{who} {_be(me)} at {_place(rng, mood)} {rng.choice(TIMES)}",
    )
    return rng.choice(choices)()


def _feeling_clause(rng: random.Random, who: str, me: Character, mood: str, about_subject: bool) -> str:
    """A clause carrying the mood; `about_subject` keeps `who` as its grammatical subject."""
    pos = mood == "positive"
    feelings = POS_FEELINGS if pos else NEG_FEELINGS
    adjectives = POS_ADJECTIVES if pos else NEG_ADJECTIVES
    verbs = POS_VERBS if pos else NEG_VERBS
    actions = POS_ACTIONS if pos else NEG_ACTIONS
    events = POS_EVENTS if pos else NEG_EVENTS
    very = rng.choice(("", "", "very ", "so ", "really "))
    about_who = (
        lambda: f"{who} felt {very}{rng.choice(feelings)}",
        lambda: f"{who} {_be(me)} {very}{rng.choice(feelings)} {rng.choice(TIMES)}",
        lambda: f"{who} {rng.choice(actions)}",
        lambda: f"{who} {rng.choice(actions)} at {_place(rng, mood)}",
        lambda: f"{who} {rng.choice(verbs)} {_noun_phrase(rng, rng.choice(THINGS), mood)}",
        lambda: f"{who} {rng.choice(events)}",
    )
    about_scene = (
        lambda: f"it was {_with_article(very + rng.choice(adjectives))} {rng.choice(DAY_WORDS)}",
        lambda: f"the {rng.choice(THINGS)} was {very}{rng.choice(adjectives)}",
        lambda: f"{me.possessive} {rng.choice(ANIMALS)} {rng.choice(ANIMAL_POS if pos else ANIMAL_NEG)}",
        lambda: f"{_place(rng, mood)} looked {rng.choice(adjectives)} and {rng.choice(adjectives)}",
    )
    choices = about_who if about_subject else about_who + about_scene
    return rng.choice(choices)()


def _quote_sentence(rng: random.Random, me: Character, mood: str) -> str:
    quotes = {"positive": POS_QUOTES, "negative": NEG_QUOTES}.get(mood, NEUTRAL_QUOTES)
    speaker = me.name if not me.plural and rng.random() < 0.5 else me.subject
    verb = rng.choice(("said", "said", "whispered", "shouted", "asked" if mood == "neutral" else "cried"))
    return f"\"{_capitalize(rng.choice(quotes))},\" {verb} {speaker}."


def _clause(rng: random.Random, who: str, me: Character, mood: str, about_subject: bool) -> str:
    if mood != "neutral" and rng.random() < 0.6:
        return _feeling_clause(rng, who, me, mood, about_subject)
    return _neutral_clause(rng, who, me, mood)


def _sentence(rng: random.Random, me: Character, mood: str, first: bool) -> str:
    """One sentence about `me`, ending with a period; the first one names the character."""
    who = me.name if first or rng.random() < 0.25 else me.subject
    if not first and rng.random() < 0.12:
        return _quote_sentence(rng, me, mood)
    clause = _clause(rng, who, me, mood, about_subject=first)
    if rng.random() < 0.25:
        joiner = rng.choice((", and ", ", but ", ", and then ", " so ", ", then "))
        # "but" turns the mood, which keeps a story from being uniformly one tone.
        next_mood = _other_mood(rng, mood) if joiner == ", but " else mood
        clause = f"{clause}{joiner}{_clause(rng, me.subject, me, next_mood, about_subject=False)}"
    if first and rng.random() < 0.4:
        clause = f"{rng.choice(OPENERS)}, {clause}"
    return _capitalize(clause) + "."


def _other_mood(rng: random.Random, mood: str) -> str:
    if mood == "positive":
        return "negative"
    if mood == "negative":
        return "positive"
    return rng.choice(("positive", "negative"))


def generate_paragraph(rng: random.Random, min_sentences: int = 3, max_sentences: int = 6) -> str:
    """A short story paragraph about one character, mostly in one mood (which may turn once)."""
    me = _new_character(rng)
    mood = rng.choices(MOODS, weights=(0.4, 0.4, 0.2))[0]
    count = rng.randint(min_sentences, max_sentences)
    sentences = []
    for index in range(count):
        if index > 1 and rng.random() < 0.15:
            mood = _other_mood(rng, mood)
        sentences.append(_sentence(rng, me, mood, first=index == 0))
    return " ".join(sentences)


def generate_paragraphs(num_sentences: int, seed: int) -> list[str]:
    """Paragraphs holding at least `num_sentences` sentences in total, deterministic in `seed`."""
    rng = random.Random(seed)
    paragraphs, total = [], 0
    while total < num_sentences:
        paragraph = generate_paragraph(rng)
        paragraphs.append(paragraph)
        total += paragraph.count(". ") + paragraph.count(".\" ") + 1
    return paragraphs


def story_openings(num: int, seed: int) -> list[str]:
    """Story openings of one or two sentences: the prompts of the sentiment/descriptiveness tasks."""
    rng = random.Random(seed)
    out = []
    while len(out) < num:
        me = _new_character(rng)
        mood = rng.choices(MOODS, weights=(0.25, 0.25, 0.5))[0]
        sentences = [_sentence(rng, me, mood, first=True)]
        if rng.random() < 0.5:
            sentences.append(_sentence(rng, me, mood, first=False))
        out.append(" ".join(sentences))
    return out
