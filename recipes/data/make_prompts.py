"""Writes distill_prompts.jsonl: the self-distillation prompt set of the SmolLM2 Medusa recipe.

Task templates crossed with topic lists, written for mtpctl (chat, code, math, summaries,
extraction, rewriting, lists, translation, questions, code explanation, writing). Seeded, so the file is reproducible:
    python recipes/data/make_prompts.py > recipes/data/distill_prompts.jsonl
It shares no prompt with the benchmark prompt set (mtpctl/data/bench_prompts.jsonl).
"""

import json
import random

TOPICS = ["photosynthesis", "compound interest", "the water cycle", "volcanoes", "black holes", "vaccines",
          "the printing press", "plate tectonics", "machine learning", "recycling plastic", "the stock market",
          "sleep and memory", "coral reefs", "electric cars", "the Roman empire", "bread baking",
          "public libraries", "solar panels", "honey bees", "the immune system", "coffee brewing",
          "chess openings", "climate change", "the human heart", "rainforests", "gravity", "earthquakes",
          "the internet", "inflation", "jazz music", "bicycles", "the moon", "glaciers", "antibiotics",
          "renewable energy", "ocean tides", "the French revolution", "origami", "sourdough", "comets"]
PEOPLE = ["a student", "a nurse", "a retired teacher", "a software engineer", "a farmer", "a child",
          "a small business owner", "a new parent", "a marathon runner", "a tourist"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "counts the vowels in a string",
              "returns the largest element of a list", "computes the factorial of n", "merges two sorted lists",
              "removes duplicates from a list while keeping order", "converts Celsius to Fahrenheit",
              "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
              "counts word frequencies in a text", "flattens a nested list", "finds the second smallest number",
              "validates an email address with a simple rule", "computes the average of a list of numbers",
              "sorts a list of dictionaries by a key", "reads a CSV file and sums a column",
              "capitalizes the first letter of each word", "returns the GCD of two integers",
              "splits a list into chunks of size k"]
LANGS = ["Python", "JavaScript", "Python", "Go", "Python", "Rust", "C", "Python"]
NAMES = ["Maria", "Tom", "Aiko", "Ravi", "Lena", "Omar", "Sofia", "Jonas", "Priya", "Diego"]
ITEMS = ["apples", "pencils", "books", "marbles", "stickers", "cookies", "tickets", "coins"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Hanoi", "Denver", "Krakow"]


def chat(r):
    t, p = r.choice(TOPICS), r.choice(PEOPLE)
    return r.choice([f"Explain {t} to {p} in a short paragraph.", f"What are three interesting facts about {t}?",
                     f"Give me some advice on learning about {t}.", f"Why does {t} matter? Answer briefly.",
                     f"Write a friendly message to {p} about {t}.", f"What is a common misconception about {t}?",
                     f"Can you describe {t} in simple words?", f"Tell me a short story that involves {t}."])


def code(r):
    return (f"Write a {r.choice(LANGS)} function that {r.choice(CODE_TASKS)}. "
            + r.choice(["Add a short docstring.", "Keep it short.", "Include one example call.", "Explain it in one line."]))


def math(r):
    a, b, c = r.randint(3, 40), r.randint(2, 15), r.randint(2, 9)
    n, m, item = r.choice(NAMES), r.choice(NAMES), r.choice(ITEMS)
    return r.choice([
        f"{n} has {a} {item} and buys {b} more, then gives {c} to {m}. How many {item} does {n} have now? Show the steps.",
        f"A train travels {a * 5} km in {c} hours. What is its average speed? Explain.",
        f"What is {a} times {b} plus {c}? Think step by step.",
        f"A shop sells {item} at {b} dollars each. How much do {a} {item} cost with a {c} dollar discount?",
        f"Solve for x: {c}x + {b} = {c * a + b}. Show your work.",
        f"{n} reads {b} pages a day. How many days to finish a {a * b} page book?"])


def summary(r):
    t, city, n = r.choice(TOPICS), r.choice(CITIES), r.choice(NAMES)
    text = (f"In {city}, a local group led by {n} started a project about {t}. Over {r.randint(2, 9)} months, "
            f"volunteers met every week, collected notes, and shared what they learned with schools. "
            f"The project grew from {r.randint(3, 12)} to {r.randint(30, 200)} members, and the city library "
            f"now hosts a monthly talk on {t}. Organizers say the hardest part was finding a meeting room.")
    return r.choice(["Summarize in one sentence:\n", "Give a two-sentence summary of this text:\n",
                     "What is the main point of the following paragraph?\n", "TL;DR:\n"]) + text


def extraction(r):
    n, city, item = r.choice(NAMES), r.choice(CITIES), r.choice(ITEMS)
    day, qty = r.choice(["Monday", "Tuesday", "Friday", "Sunday"]), r.randint(2, 50)
    text = f"{n} ordered {qty} {item} on {day} to be delivered to {city}."
    return r.choice([f"Extract the name, quantity, item and city from this sentence as JSON: {text}",
                     f"From the text, list who, what and where: {text}",
                     f"Return a YAML record with fields person, day and city for: {text}"])


def rewrite(r):
    t = r.choice(TOPICS)
    sentence = f"I think that {t} is kind of really important for a lot of people in many different ways."
    return r.choice([f"Rewrite this sentence to be concise: {sentence}",
                     f"Make this sentence more formal: {sentence}", f"Fix the style of: {sentence}",
                     f"Turn this into a question: {sentence}"])


def lists(r):
    t, city = r.choice(TOPICS), r.choice(CITIES)
    return r.choice([f"List five key terms related to {t} with one-line definitions.",
                     f"Give a numbered list of steps to start learning about {t}.",
                     f"Plan a one-day visit to {city} as a bulleted list.",
                     f"List pros and cons of {t}.", f"Write a short checklist for a trip to {city}."])


PHRASES = ["Good morning, how are you today?", "The library opens at nine o'clock.", "Please close the window.",
           "I would like a cup of tea.", "Where is the train station?", "The weather is lovely this week.",
           "We are meeting at the cafe after work.", "This book changed the way I think."]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
SNIPPETS = ["for i in range(10):\n    print(i * i)", "def add(a, b):\n    return a + b",
            "items = [x for x in data if x > 0]", "while n > 1:\n    n = n // 2\n    steps += 1",
            "const total = prices.reduce((a, b) => a + b, 0);", "SELECT name FROM users WHERE age > 30;"]


def translate(r):
    return f"Translate into {r.choice(LANGUAGES)}: {r.choice(PHRASES)}"


def qa(r):
    t = r.choice(TOPICS)
    return r.choice([f"Who first studied {t}, and when? Answer in two sentences.", f"How does {t} work?",
                     f"Is {t} good or bad for the environment? Explain briefly.",
                     f"What would happen without {t}?", f"Compare {t} with {r.choice(TOPICS)}."])


def explain_code(r):
    return r.choice(["Explain what this code does:\n", "Find a bug or improvement in:\n",
                     "Add comments to this code:\n", "Rewrite this more clearly:\n"]) + r.choice(SNIPPETS)


def writing(r):
    n, city, t = r.choice(NAMES), r.choice(CITIES), r.choice(TOPICS)
    return r.choice([f"Write a short email to {n} inviting them to a talk about {t} in {city}.",
                     f"Write a haiku about {t}.", f"Write a product description for a guidebook to {city}.",
                     f"Write a polite reply declining a meeting with {n}.",
                     f"Write three quiz questions about {t} with answers."])


COUNT = 320  # prompts written; the hand-written files (written_*.jsonl) carry most of the variety
KINDS = [chat, chat, code, math, math, summary, extraction, rewrite, lists, translate, qa, explain_code, writing]

if __name__ == "__main__":
    rng = random.Random(2026)
    seen = set()
    attempt = 0
    while len(seen) < COUNT and attempt < 100_000:  # kinds in turn; a kind out of new prompts is skipped
        kind = KINDS[attempt % len(KINDS)]
        attempt += 1
        prompt = kind(rng)
        if prompt not in seen:
            seen.add(prompt)
            print(json.dumps({"prompt": prompt, "task": kind.__name__}))
