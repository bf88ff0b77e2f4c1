"""Everyday requests to a chat assistant, made from templates and topic lists: the prompts
scripts/train_draft_head.py distills the target's answers to (what people ask, in the shapes they ask it). The
questions scripts/bench_speculative.py holds out (seasons, refrigerators, weather and climate, emails, a painting
robot, how laws are made) are kept out of these lists, so its figures stay measured on unseen requests."""
import random

CONCEPTS = [
    "photosynthesis", "black holes", "the theory of evolution", "gravity", "the immune system", "DNA", "electricity",
    "the water cycle", "plate tectonics", "the Renaissance", "the Industrial Revolution", "democracy", "inflation",
    "supply and demand", "compound interest", "machine learning", "the internet", "cloud computing", "encryption",
    "blockchain", "renewable energy", "nuclear power", "the solar system", "the Big Bang", "quantum physics",
    "the Roman Empire", "ancient Egypt", "the printing press", "the human brain", "sleep", "nutrition", "vitamins",
    "meditation", "mindfulness", "stress", "friendship", "leadership", "teamwork", "public speaking", "negotiation",
    "critical thinking", "the scientific method", "probability", "statistics", "algebra", "geometry", "prime numbers",
    "the Pythagorean theorem", "recycling", "biodiversity", "coral reefs", "rainforests", "deserts", "volcanoes",
    "the ocean's tides", "the Moon", "Mars", "the stock market", "credit scores", "taxes", "budgeting",
    "entrepreneurship", "marketing", "social media", "artificial intelligence", "robotics", "3D printing",
    "virtual reality", "video games", "jazz", "classical music", "impressionist art", "photography",
    "poetry", "mythology", "philosophy", "ethics", "psychology", "habits", "motivation", "memory", "language learning",
    "bilingualism", "the Olympic Games", "chess", "soccer", "yoga", "marathon training", "gardening", "composting",
    "beekeeping", "bread baking", "coffee", "tea", "chocolate", "vaccines", "antibiotics", "the heart",
    "the digestive system", "bacteria", "viruses", "genetics", "cells", "atoms", "chemical reactions", "magnetism",
    "light", "sound", "the speed of light", "electric cars", "airplanes", "satellites", "the space station",
    "time zones", "maps", "the metric system", "money", "banks", "insurance", "the Silk Road", "the Cold War",
    "the Great Wall of China", "the pyramids", "architecture", "urban planning", "public transport", "libraries",
    "museums", "open source software", "operating systems", "databases", "programming languages", "recursion",
    "sorting algorithms", "the binary number system", "password security", "online privacy",
]
DEVICES = [
    "a microwave oven", "a solar panel", "a wind turbine", "a battery", "a car engine", "an electric motor",
    "a computer", "a smartphone", "a touchscreen", "a camera", "a telescope", "a microscope", "GPS", "Wi-Fi",
    "a search engine", "a web browser", "a printer", "a thermostat", "an air conditioner", "a dishwasher",
    "a washing machine", "a bicycle", "a clock", "a compass", "a lock and key", "an elevator", "a hydroelectric dam",
    "a nuclear reactor", "a rocket", "a helicopter", "a submarine", "a radio", "a television", "a speaker",
    "a hearing aid", "an X-ray machine", "a vaccine", "a credit card", "a barcode scanner", "a traffic light",
    "a heat pump", "a pressure cooker", "a toaster", "an electric kettle", "a hard drive", "a keyboard",
]
PHENOMENA = [
    "earthquakes", "rainbows", "thunderstorms", "hurricanes", "tides", "the northern lights", "eclipses",
    "volcanic eruptions", "ocean currents", "fog", "snowflakes", "lightning", "wind", "droughts", "floods",
    "inflation", "recessions", "traffic jams", "jet lag", "hiccups", "yawning", "muscle cramps", "allergies",
    "fever", "headaches", "goosebumps", "dreams", "deja vu", "procrastination", "stage fright", "echoes",
    "static electricity", "rust", "bread to rise", "leaves to change color in autumn", "the sky to look blue",
    "sunsets to look red", "the Moon's phases", "shooting stars",
]
ACTIVITIES = [
    "learning to play the guitar", "starting a vegetable garden", "running a first marathon", "learning to cook",
    "traveling on a budget", "studying for exams", "preparing for a job interview", "writing a resume",
    "learning a new language", "starting a small business", "saving money", "investing for the first time",
    "buying a used car", "moving to a new city", "training a puppy", "taking better photos", "learning to code",
    "writing a novel", "keeping a journal", "hiking in the mountains", "camping with kids", "organizing a closet",
    "decorating a small apartment", "hosting a dinner party", "planning a wedding", "learning to swim",
    "learning to draw", "making new friends as an adult", "working from home", "managing a team",
    "giving a presentation", "negotiating a salary", "reading more books", "reducing screen time",
    "eating healthier", "getting back into exercise", "meal prepping", "baking sourdough bread",
    "caring for houseplants", "tiling a bathroom floor", "fixing a flat bicycle tire", "teaching a child to read",
    "volunteering in the community", "preparing for a long flight", "backpacking through Europe",
    "learning chess", "birdwatching", "running a meeting", "writing a cover letter", "starting a podcast",
]
GOALS = [
    "sleep better", "stay focused while studying", "improve my memory", "become more confident",
    "manage my time better", "reduce stress", "save money on groceries", "get better at math", "write better essays",
    "stop procrastinating", "drink more water", "wake up earlier", "be more productive at work",
    "improve my posture", "make my home more energy efficient", "become a better listener", "learn faster",
    "get over a cold faster", "keep my plants alive", "reduce my plastic waste", "speak more clearly",
    "stay motivated to exercise", "build a daily routine", "prepare for a job interview", "handle criticism",
    "make friends in a new city", "pay off debt", "learn to type faster", "improve my handwriting",
    "spend less time on my phone", "cook healthy meals quickly", "remember names", "stay calm in an argument",
    "start running", "read faster", "organize my notes", "be more creative", "apologize sincerely",
]
PAIRS = [
    ("a virus", "a bacterium"), ("a comet", "an asteroid"), ("a crocodile", "an alligator"), ("baking soda",
    "baking powder"), ("a hurricane", "a tornado"), ("RAM", "storage"), ("a CPU", "a GPU"), ("Python", "JavaScript"),
    ("a stock", "a bond"), ("a debit card", "a credit card"), ("a democracy", "a republic"), ("speed", "velocity"),
    ("mass", "weight"), ("a simile", "a metaphor"), ("a frog", "a toad"), ("a lake", "a pond"), ("a rabbit",
    "a hare"), ("an ocean", "a sea"), ("a meteor", "a meteorite"), ("a cold", "the flu"), ("empathy", "sympathy"),
    ("a fruit", "a vegetable"), ("an atom", "a molecule"), ("a star", "a planet"), ("a dolphin", "a shark"),
    ("machine learning", "traditional programming"), ("the internet", "the web"), ("a loan", "a grant"),
    ("a sprint", "a marathon"), ("coffee", "tea"), ("renting", "buying a home"), ("a novel", "a short story"),
    ("an introvert", "an extrovert"), ("a latte", "a cappuccino"), ("a violin", "a viola"), ("butter", "margarine"),
]
CHARACTERS = [
    "a lonely lighthouse keeper", "a young dragon", "a curious cat", "an old sailor", "a girl who can talk to birds",
    "a tired detective", "a shy ghost", "a brave mouse", "a baker in a small village", "two friends on a road trip",
    "a lost astronaut", "a talking tree", "a retired wizard", "a boy and his grandfather", "a clever fox",
    "a street musician", "a family of penguins", "a new teacher", "a time traveler", "a knight who is afraid of the dark",
]
SITUATIONS = [
    "finds a mysterious map", "gets lost in a big city", "discovers a hidden door", "makes an unlikely friend",
    "has to save the village", "wins a strange contest", "loses something precious", "learns a secret",
    "travels to another planet", "opens a small shop", "cannot stop laughing", "finds a message in a bottle",
    "wakes up with a new power", "visits the sea for the first time", "has one day to fix a mistake",
]
KINDS = ["poem", "song", "haiku", "limerick", "speech", "thank-you note", "blog post", "product description",
         "motivational quote", "toast for a birthday party", "review of an imaginary restaurant", "joke", "riddle"]
CODE_TASKS = [
    "reverse a string", "read a CSV file", "sort a list of dictionaries by a key", "count the words in a text",
    "check if a number is prime", "find the largest number in a list", "remove duplicates from a list",
    "merge two dictionaries", "read a JSON file", "download a web page", "make a simple calculator",
    "compute the Fibonacci numbers", "validate a phone number", "convert Celsius to Fahrenheit",
    "find the most common element in a list", "check if a word is a palindrome", "generate a random password",
    "flatten a nested list", "measure how long a function takes", "write a class for a bank account",
    "handle errors when opening a file", "split a sentence into words", "compute an average", "parse a date",
    "sort a list without using sort()", "search a list with binary search", "rename files in a folder",
]
MATH = [
    "percentages", "fractions", "the area of a circle", "long division", "simple interest", "the mean and median",
    "negative numbers", "square roots", "exponents", "the slope of a line", "the volume of a cube", "ratios",
    "probability with dice", "converting units", "solving a linear equation", "the order of operations",
    "rounding numbers", "the perimeter of a rectangle", "a standard deviation", "a derivative",
]
PLACES = [
    "Paris", "Tokyo", "Rome", "New York", "Cairo", "Istanbul", "Rio de Janeiro", "Sydney", "Iceland", "Kenya",
    "Peru", "Canada", "India", "Mexico City", "Barcelona", "Amsterdam", "Vienna", "Kyoto", "Cape Town", "Bangkok",
    "Scotland", "New Zealand", "Greece", "Norway", "Vietnam", "Morocco", "Chile", "Prague", "Lisbon", "Seoul",
]
FOODS = [
    "pancakes", "a tomato soup", "guacamole", "banana bread", "a vegetable curry", "fried rice", "hummus",
    "a chocolate cake", "homemade pizza", "pasta carbonara", "a Greek salad", "chicken noodle soup", "oatmeal cookies",
    "scrambled eggs", "lemonade", "sushi rolls", "a fruit smoothie", "tacos", "apple pie", "a lentil stew",
]
EXPLAIN = ["", "", "", " Answer briefly.", " Answer in a short paragraph.", " Use a numbered list.",
           " Keep it simple.", " Give an example."]
CHAT = [  # (templates, values, whether an answer-style suffix may follow)
    (["What should I know about {x}?", "Explain {x} in simple terms.", "Explain {x} to a ten-year-old.", "Why is {x} important?",
      "Tell me about {x}.", "What are the main ideas behind {x}?", "Write a short paragraph about {x}.",
      "List five facts about {x}.", "Give me a short history of {x}.", "What are common misconceptions about {x}?",
      "How would you describe {x} to someone who has never heard of it?"], CONCEPTS, True),
    (["How does {x} work?", "Explain how {x} works, step by step.", "What are the main parts of {x}?",
      "Who invented {x}, and why did it matter?"], DEVICES, True),
    (["What causes {x}?", "Explain what causes {x}."], PHENOMENA, True),
    (["Give me some tips for {x}.", "How do I get started with {x}?", "What are common mistakes people make when {x}?",
      "Make a simple plan for {x}.", "What do I need for {x}?"], ACTIVITIES, True),
    (["How can I {x}?", "What are three ways to {x}?", "I want to {x}. Where should I start?",
      "Give me a one-week plan to {x}."], GOALS, True),
    (["What is the difference between {a} and {b}?", "Compare {a} and {b}.",
      "What do {a} and {b} have in common?"], [{"a": a, "b": b} for a, b in PAIRS], True),
    (["Write a short story about {x}.", "Write the opening paragraph of a story about {x}.",
      "Tell me a bedtime story about {x}."], [f"{c} who {s}" for c in CHARACTERS for s in SITUATIONS], False),
    (["Write a {k} about {x}.", "Can you write a {k} about {x}?"],
     [{"k": k, "x": x} for k in KINDS for x in CONCEPTS + PLACES], False),
    (["How do I {x} in Python?", "Write a Python function to {x}.", "Show me how to {x} in JavaScript."],
     CODE_TASKS, False),
    (["Explain {x} with an example.", "How do I work out {x}?", "Teach me {x} step by step."], MATH, True),
    (["What is {x} famous for?", "Plan a three-day trip to {x}.", "Tell me about the history of {x}.",
      "What should I eat when I visit {x}?"], PLACES, True),
    (["How do I make {x}?", "Give me a simple recipe for {x}.", "What goes well with {x}?"], FOODS, True),
]


def chat_questions(count: int, rng: random.Random) -> list:
    """`count` different requests (fewer if the lists run out), each template about as likely as any other."""
    weights = [len(templates) for templates, _, _ in CHAT]
    out, seen = [], set()
    for _ in range(50 * count):
        if len(out) == count:
            break
        templates, values, explain = rng.choices(CHAT, weights)[0]
        value = rng.choice(values)
        text = rng.choice(templates).format(**(value if isinstance(value, dict) else {"x": value}))
        text = text + (rng.choice(EXPLAIN) if explain else "")
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
