"""The broad evaluation set: prompts that look like a chat assistant's real traffic, ten categories weighted equally.

    python -m data.broad_eval            # writes data/default/eval_broad.jsonl (the shipped file is its output)

Rows as in eval_prompts.jsonl ({id, category, messages}). Eight categories are written here by hand (the tables
below, 30 varied requests each); two are taken from the shipped data/default/eval_prompts.jsonl, so the
whole file rebuilds without any package:
  code_complete  every 5th HumanEval task (HumanEval/0, /5, ..., /160: 33 prompts), as eval_prompts.jsonl words it
  multiturn      the 40 odd-numbered MT-Bench questions with both user turns and an assistant placeholder between
                 them ({"role": "assistant", "content": null}): eval_dflash.py fills it with the target's greedy
                 answer to the first turn (untimed, not counted) and measures tau on the answer to the second
  system         an app's own system prompt (support desks, tutors, personas, format rules) before the user's
                 request, as served traffic mostly comes; none of these system prompts is in
                 data/default/systems.jsonl, the training side's (data.synthesize --systems)
Every row is held out of training data (data/filters.py HELDOUT_DEFAULTS holds this file).
"""
import argparse
import json
from pathlib import Path

from data.sources import write_jsonl

DEFAULT = Path(__file__).resolve().parent / "default"
OUT = DEFAULT / "eval_broad.jsonl"
SOURCE = DEFAULT / "eval_prompts.jsonl"   # HumanEval + odd MT-Bench (data.sources)
HUMANEVAL_EVERY = 5                       # code_complete: HumanEval ids divisible by this

# --- hand-written prompts -------------------------------------------------------------------------------------------

CHAT = [
    "hey! how's your day going so far?",
    "I just got back from a 10k run and my legs feel like jelly lol. do you ever wish you could go for a run?",
    "Good morning :) I'm on my second coffee and still not awake. Any tips for surviving a Monday?",
    "My cat knocked my plant off the windowsill again. Why do cats do that??",
    "I'm bored at the airport, my flight is delayed three hours. Entertain me a bit?",
    "what's your favourite season and why? mine is autumn, the light is just better",
    "I finally finished the book I've been reading for two months. Feels weirdly sad that it's over.",
    "Can you tell me a joke? Something clean, it's for my 8 year old nephew.",
    "ugh, rainy Saturday and all my plans got cancelled. what would you do with a free rainy day",
    "Do you think it's weird to eat cereal for dinner? Asking for myself.",
    "I'm nervous about my first day at a new job tomorrow. Just wanted to tell someone.",
    "Would you rather be able to fly or be invisible? I keep changing my answer.",
    "My friend says pineapple on pizza is a crime. Settle this for us please.",
    "just adopted a puppy!!! she's a beagle mix and she won't stop chewing my shoelaces",
    "I've been learning to bake bread during lockdown and my sourdough finally rose. Proud moment.",
    "Honestly I can't decide what to watch tonight. Something funny but not stupid. Ideas?",
    "it's 2am and I can't sleep. talk to me about something calming",
    "Do you like music? If you had to pick one genre to listen to forever, what would it be?",
    "I just moved to a new city and don't know anybody yet. How do people make friends as adults?",
    "Tell me something interesting I probably don't know.",
    "I burned the pancakes. All of them. Every single one. How's your morning?",
    "What's a good name for a goldfish? He's orange and kind of grumpy-looking.",
    "Guess what, I passed my driving test on the third try!",
    "Is it just me or does time go faster as you get older?",
    "I'm planning a surprise party for my sister's 30th and I'm terrible at keeping secrets. Help me stay calm haha",
    "Do you ever get tired of answering questions all day?",
    "ok random question but what's the best sandwich you can make with only what's in a student fridge",
    "Had a really good conversation with my grandma today about her childhood in a fishing village. Made my week.",
    "Any recommendations for a podcast to listen to on a long drive? I like history and true stories.",
    "I tried yoga for the first time and could not touch my toes at all. Is that normal?",
]

EXPLAIN = [
    "What is photosynthesis, in simple terms?",
    "Can you explain how a blockchain works without using jargon?",
    "Why is the sky blue but sunsets are orange and red?",
    "Explain the difference between a virus and a bacterium.",
    "What does inflation actually mean, and why do central banks raise interest rates to fight it?",
    "How do vaccines train the immune system?",
    "I keep hearing about 'opportunity cost' in my economics class. What is it, with an everyday example?",
    "What is the difference between weather and climate?",
    "Explain recursion to someone who has never programmed before.",
    "How does GPS figure out where my phone is?",
    "What causes the seasons? I always thought it was the distance from the sun.",
    "Can you explain what a black hole is and why light can't escape it?",
    "What's the difference between RAM and storage on a computer?",
    "Why do we have leap years?",
    "Explain the concept of supply and demand like I'm 12.",
    "What is entropy? My physics teacher explained it as 'disorder' and that didn't help.",
    "How does the stock market work, and what does it mean to own a share of a company?",
    "What's the difference between machine learning and traditional programming?",
    "Why does ice float on water when most solids sink in their own liquid?",
    "Explain how compound interest works and why people say to start saving early.",
    "What is the placebo effect and how do researchers control for it in drug trials?",
    "How do noise-cancelling headphones work?",
    "What is the difference between a democracy and a republic?",
    "Can you explain what DNA is and how it stores information?",
    "Why do some metals rust and others don't?",
    "What is cognitive dissonance? Give me a couple of examples from daily life.",
    "How does public-key cryptography let two people talk securely without sharing a secret first?",
    "What actually happens in my body when I have a fever?",
    "Explain the Pythagorean theorem and why it's true, with a simple proof.",
    "What is the greenhouse effect, and how is it different from the hole in the ozone layer?",
]

HOWTO = [
    "How do I change a flat tire on my car? I've never done it.",
    "My laptop is running really slow lately (Windows 11). What can I try before buying a new one?",
    "How do I set up a Python virtual environment and install packages into it?",
    "What's the best way to get a red wine stain out of a light carpet?",
    "My Wi-Fi keeps dropping every few minutes but my phone's mobile data is fine. How do I troubleshoot this?",
    "How do I make a budget if I've never made one before? I get paid every two weeks.",
    "Step by step, how do I undo my last git commit but keep the changes in my working directory?",
    "How can I back up all the photos on my iPhone to my computer without iCloud?",
    "What's the right way to season a new cast iron pan?",
    "How do I write a good cover letter for a job I'm slightly underqualified for?",
    "My printer says it's offline even though it's connected to the network. What do I do?",
    "How do I repot a houseplant that has outgrown its pot without killing it?",
    "How do I set up two-factor authentication on my Google account?",
    "What's the easiest way to learn to touch type as an adult?",
    "How do I bleed a radiator? The top of it is cold but the bottom is hot.",
    "My Excel VLOOKUP returns #N/A even though I can see the value in the table. How do I fix it?",
    "How do I prepare for a behavioural job interview? They said to expect 'tell me about a time' questions.",
    "How do I find out what's using all the disk space on my Mac?",
    "What's a simple way to start composting in a small apartment?",
    "How do I safely jump-start a car with another car?",
    "How can I stop my bathroom mirror from fogging up after a shower?",
    "I forgot the password to my home router's admin page. How do I reset it?",
    "How do I schedule a daily job on Linux that runs a backup script at 3am?",
    "What's the best way to pack a suitcase so clothes don't wrinkle?",
    "How do I unclog a bathroom sink without using harsh chemicals?",
    "How do I get my toddler to go to sleep without an hour-long battle every night?",
    "How do I export a Google Sheet as a CSV and open it in Python with pandas?",
    "My phone battery drains really fast since the last update. Any fixes?",
    "How do I hang a heavy mirror on a drywall wall securely?",
    "How do I start running if I'm completely out of shape? I want to do a 5k in three months.",
]

WRITING = [
    "Write a short story about a lighthouse keeper who receives a letter from someone who died fifty years ago.",
    "Write a poem about the first snowfall of the year, in free verse.",
    "Write a limerick about a programmer who can't find a missing semicolon.",
    "Write a bedtime story for a five-year-old about a dragon who is afraid of the dark.",
    "Write the opening paragraph of a mystery novel set in a small seaside town in the 1950s.",
    "Write a haiku sequence (three haiku) about a city at night.",
    "Write a heartfelt best man speech for my brother's wedding. He's a firefighter and met his wife at a climbing "
    "gym.",
    "Write a short sci-fi story in which humanity's first message from aliens turns out to be an apology.",
    "Write a product description for a handmade ceramic coffee mug that sounds cozy but not cheesy.",
    "Write a sonnet about missing someone who lives in another time zone.",
    "Write a funny dialogue between a cat and a robot vacuum cleaner.",
    "Write a motivational letter to my future self to open in ten years.",
    "Write a short horror story that takes place entirely inside an elevator.",
    "Write song lyrics (verse and chorus) about driving home after a long summer.",
    "Write a fable with a moral about patience, featuring a tortoise and a river.",
    "Write a scene where two old friends meet by chance at a train station after twenty years apart.",
    "Write a short poem for my mom's 60th birthday card. She loves gardening.",
    "Write a travel blog intro about arriving in Lisbon for the first time.",
    "Write a dramatic monologue for a villain who believes they're the hero.",
    "Write a flash fiction piece (under 300 words) about the last tree on Earth.",
    "Write a children's rhyme that helps kids remember the planets in order.",
    "Write a cozy fantasy story about a bakery that sells bread that makes people remember happy memories.",
    "Write a eulogy for a beloved family dog named Biscuit who lived to 15.",
    "Write a short noir detective story where the detective is a pigeon.",
    "Write an inspiring speech for a high school graduation about failing forward.",
    "Write a letter from a medieval knight to his family describing his first sight of the ocean.",
    "Write a comedic review of a toaster as if it were a fine-dining restaurant.",
    "Write a poem in the style of a weather forecast, but about emotions.",
    "Write the first chapter outline of a young adult novel about a girl who can hear other people's lies.",
    "Write a short love story told entirely through text messages.",
]

REWRITE = [
    "Summarize this in two sentences:\n\nThe city council voted on Tuesday to approve a new bike lane network that "
    "will connect the downtown area with three residential neighbourhoods. The project, which will cost an estimated "
    "$4.2 million, is expected to take two years to complete. Supporters argue it will reduce traffic and improve "
    "safety for cyclists, while some local business owners worry that removing parking spaces will hurt their sales. "
    "Construction is scheduled to begin next spring.",
    "Make this email sound more professional:\n\nhey mark, so i cant make the meeting thursday cause something came "
    "up. can we move it to next week sometime? also i still havent got the numbers from your team, need those asap. "
    "thx",
    "Rewrite this paragraph so a ten-year-old could understand it:\n\nMitochondria are membrane-bound organelles "
    "that generate most of the chemical energy needed to power the cell's biochemical reactions. This energy is "
    "stored in a small molecule called adenosine triphosphate (ATP), which is produced through a process known as "
    "cellular respiration.",
    "Extract all the dates and what happens on each one from this text, as a list:\n\nThe conference opens on March "
    "3 with a keynote by Dr. Lee. Workshops run from March 4 to March 6. The poster session is on the evening of "
    "March 5, and the closing dinner takes place on March 7. Registration closes on February 15.",
    "Fix the grammar and spelling in this, but keep my tone:\n\nI has been working on this project for three month "
    "and honestly its been the best experiance of my carreer so far, the team is amazing and we learnt alot from "
    "each other.",
    "Turn these notes into a short, friendly paragraph for our team newsletter:\n\n- new coffee machine in kitchen "
    "(finally)\n- office closed Friday 14th for maintenance\n- welcome Priya, new designer, starts Monday\n- summer "
    "party date TBD, vote in the poll",
    "Summarize the main argument of this passage in one sentence:\n\nMany people believe that multitasking makes "
    "them more productive, but research suggests otherwise. When we switch between tasks, our brains need time to "
    "refocus, and these small delays add up. Studies have found that people who frequently multitask perform worse "
    "on memory tests and take longer to finish tasks than those who focus on one thing at a time. In short, doing "
    "less at once may help us get more done.",
    "Rewrite this sentence in five different ways, from very formal to very casual:\n\n\"We need to postpone the "
    "launch because the testing isn't finished.\"",
    "Pull out the names, job titles and companies mentioned here and put them in a table:\n\nAt the panel, Sarah "
    "Kim, chief technology officer at Nimbus Labs, spoke alongside Daniel Ortiz, a senior analyst with Greenfield "
    "Capital. The session was moderated by Aisha Bello, editor at TechWeekly.",
    "Shorten this product description to under 40 words without losing the key selling points:\n\nOur new "
    "TrailLite backpack is designed for hikers who want comfort without compromise. Made from recycled ripstop "
    "nylon, it weighs just 900 grams yet holds up to 35 litres. The ventilated back panel keeps you cool on long "
    "climbs, while the adjustable hip belt spreads the load evenly. It also features a built-in rain cover, a "
    "hydration sleeve and six external pockets for quick access to your essentials.",
    "Translate this into plain English, no legal jargon:\n\nThe lessee shall indemnify and hold harmless the lessor "
    "from and against any and all claims arising out of the lessee's use of the premises, save where such claims "
    "result from the gross negligence of the lessor.",
    "Convert this recipe into a numbered list of steps:\n\nFirst melt the butter in a pan, then add the onions and "
    "cook them until they're soft, about five minutes. After that stir in the garlic and cook for another minute "
    "before pouring in the tomatoes. Let it simmer for twenty minutes, season with salt and pepper, and finally "
    "stir in the fresh basil just before serving.",
    "Rewrite this customer review to be more polite but keep the complaint clear:\n\nWorst delivery ever. The box "
    "showed up three days late and totally smashed. Nobody answered the phone when I called. Never ordering from "
    "you people again.",
    "Give me three bullet points summarizing this meeting transcript:\n\nAnna: Okay, so the prototype is ready for "
    "user testing. Ben: Great, I can recruit eight participants by next Wednesday. Anna: We also need to fix the "
    "login bug before then. Carlos: I'll handle the bug, should be done Monday. Ben: And the budget for incentives? "
    "Anna: Let's keep it at $50 per person.",
    "Paraphrase this quote so it doesn't sound like a direct copy:\n\n\"The only way to do great work is to love "
    "what you do. If you haven't found it yet, keep looking. Don't settle.\"",
    "Extract the key facts from this news snippet as JSON with fields city, magnitude, time, injuries:\n\nA "
    "magnitude 5.8 earthquake struck near the city of Izmir at 3:42 a.m. local time on Sunday. Authorities reported "
    "12 minor injuries and some damage to older buildings, but no deaths.",
    "Rewrite this paragraph in the active voice:\n\nThe report was written by the committee last year. Several "
    "errors were found by the reviewers, and the final version was approved by the board only after the changes "
    "had been made by the authors.",
    "Make this cover letter paragraph more confident and concise:\n\nI think that I might be a good fit for this "
    "position because I have sort of worked in customer service for a few years, and I feel like I am pretty good "
    "at talking to people and solving their problems, if that makes sense.",
    "Summarize this story in one paragraph:\n\nMaya had always been afraid of water. When her family moved to a "
    "small island, she avoided the beach for an entire summer. One day her younger brother's kite blew into the "
    "shallow water, and without thinking she waded in to grab it. The water was warm and calm. The next morning she "
    "asked her father to teach her to swim, and by the end of the year she was the first one in the sea every day.",
    "Change this text from British to American spelling and vocabulary:\n\nI put the rubbish in the bin, grabbed "
    "my favourite jumper and walked to the chemist's to pick up my prescription. The colour of the autumn leaves "
    "along the pavement was lovely.",
    "Classify each of these support tickets as billing, technical or account, and explain briefly:\n\n1. I was "
    "charged twice this month.\n2. The app crashes when I open the camera.\n3. How do I change the email on my "
    "profile?\n4. My invoice shows the wrong company name.",
    "Rewrite this tweet to be less angry but still firm:\n\nUnbelievable that the trains are late AGAIN. Third "
    "time this week. Do you people even care about your passengers??",
    "Condense these instructions into a short checklist:\n\nBefore you leave the lab, please make sure that all "
    "the burners are turned off and that the gas valves are closed. Any chemicals that you used should be returned "
    "to the cabinet, and waste must go in the labelled containers, not the sink. Wipe down your bench with "
    "disinfectant and, finally, remember to sign the logbook with the time you left.",
    "Turn this dialogue into a third-person narrative paragraph:\n\nTom: \"Did you lock the door?\"\nLisa: \"I "
    "thought you did.\"\nTom: \"Great. So the house is open.\"\nLisa: \"Relax, I'll call the neighbour.\"",
    "Pick out the action items from this email and say who owns each:\n\nHi all, thanks for today. Jenna will send "
    "the revised budget by Friday. Omar, could you book the venue for the June workshop? I'll draft the agenda and "
    "circulate it next week. Also, everyone please fill in the availability form by Wednesday.",
    "Rewrite this abstract as a short plain-language summary for a general audience:\n\nWe conducted a randomized "
    "controlled trial with 240 adults to assess the effect of a twelve-week mindfulness intervention on self-reported "
    "stress. Participants in the intervention group showed a statistically significant reduction in perceived stress "
    "scores compared with the waitlist control group (p < 0.01), with effects persisting at a three-month follow-up.",
    "Make this paragraph more vivid and descriptive:\n\nThe market was busy. There were a lot of people and many "
    "stalls selling food. It was hot and it smelled good.",
    "Summarize the pros and cons in this text as two lists:\n\nRemote work gives employees flexibility and saves "
    "them commuting time, and companies can hire talent from anywhere. On the other hand, some people feel isolated, "
    "communication can be slower, and it can be harder to separate work from home life.",
    "Rewrite these instructions for a non-technical user:\n\nTo resolve the issue, clear your browser cache, "
    "disable any extensions that inject scripts, and perform a hard refresh (Ctrl+Shift+R). If the problem "
    "persists, check the developer console for CORS errors.",
    "Correct the facts in this paragraph if any are wrong, and list what you changed:\n\nThe Eiffel Tower was "
    "built in 1920 for the Olympic Games in Paris. It is made of steel and stands about 100 metres tall, making it "
    "the tallest structure in France.",
]

REASONING = [
    "A train leaves at 2:45 pm and the journey takes 3 hours and 50 minutes. What time does it arrive?",
    "If 5 machines make 5 widgets in 5 minutes, how long would 100 machines take to make 100 widgets?",
    "A shirt costs $40. It's discounted by 25%, and then a further 10% is taken off the sale price. What's the "
    "final price, and is that the same as a 35% discount?",
    "Sam is twice as old as Lily. In 6 years, Sam will be 1.5 times as old as Lily. How old are they now?",
    "I have a 3-litre jug and a 5-litre jug and unlimited water. How can I measure exactly 4 litres?",
    "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. How much does the ball cost? "
    "Explain your reasoning.",
    "There are three boxes: one has only apples, one only oranges, and one both. All labels are wrong. You can take "
    "one fruit from one box. How do you relabel them correctly?",
    "A recipe for 4 people needs 300 g of flour and 2 eggs. How much of each do I need for 10 people?",
    "If it takes 6 people 4 days to paint a house, how long would it take 8 people, assuming they work at the same "
    "rate?",
    "I drive 120 km at 60 km/h and then 120 km back at 40 km/h. What's my average speed for the whole trip?",
    "All bloops are razzies and all razzies are lazzies. Are all bloops definitely lazzies? Are all lazzies bloops?",
    "A rectangle's length is 3 cm more than its width, and its area is 70 square cm. What are its dimensions?",
    "You flip a fair coin three times. What's the probability of getting at least two heads?",
    "My monthly salary is $3,200. I spend 30% on rent, 15% on food, and save half of what's left. How much do I "
    "save each month?",
    "Five friends sit in a row. Anna is not at either end. Ben sits right next to Carl. Dana sits at the left end. "
    "Eve sits to the right of Ben. Find one possible seating order that satisfies all of this.",
    "A water tank fills in 6 hours with pipe A and 4 hours with pipe B. How long does it take with both pipes open?",
    "What's the next number in the sequence 2, 6, 12, 20, 30, ...? Explain the pattern.",
    "If today is Wednesday, what day of the week will it be 100 days from now?",
    "A store sells pencils at 3 for $1 and notebooks at $2.50 each. I have $12 and need at least 2 notebooks. What's "
    "the most pencils I can buy?",
    "A farmer has chickens and cows. There are 30 heads and 74 legs in total. How many of each animal are there?",
    "Is this argument valid? 'If it rains, the ground gets wet. The ground is wet. Therefore, it rained.' Explain.",
    "An investment grows by 10% in the first year and falls by 10% in the second. Is it back to where it started?",
    "How many different ways can you arrange the letters of the word LEVEL?",
    "A clock shows 3:15. What is the angle between the hour and the minute hands?",
    "Tom reads 12 pages an hour and Jerry reads 18 pages an hour. They start the same 360-page book at the same time. "
    "How far is Tom when Jerry finishes?",
    "In a class of 30 students, 18 play football, 12 play basketball and 5 play both. How many play neither?",
    "A car's fuel efficiency is 6.5 litres per 100 km. Fuel costs 1.80 per litre. How much does a 450 km trip cost?",
    "Three people check into a hotel room that costs $30 and each pays $10. The manager realises the room is $25 and "
    "gives the bellboy $5 to return. The bellboy keeps $2 and gives each guest $1 back. Each guest paid $9, that's "
    "$27, plus the bellboy's $2 is $29. Where's the missing dollar?",
    "A number is divisible by 3 and by 4, and it's between 50 and 70. What could it be?",
    "If I save $50 in the first week and add $10 more each week than the week before, how much will I have saved "
    "after 12 weeks?",
]

CODE_INSTRUCT = [
    "Write a Python function that checks whether a string is a palindrome, ignoring spaces, punctuation and case.",
    "Write a SQL query that returns the top 5 customers by total order amount from tables customers(id, name) and "
    "orders(id, customer_id, amount).",
    "Write a bash script that renames all .jpeg files in the current directory to .jpg.",
    "Write a JavaScript function that debounces another function with a given delay in milliseconds.",
    "In Python, write a function that merges two sorted lists into one sorted list without using sort().",
    "Write a Python script that reads a CSV file of expenses (date, category, amount) and prints the total per "
    "category.",
    "Write a regular expression that matches valid email addresses reasonably well, and explain each part.",
    "Write a simple REST API in Flask with endpoints to create, list and delete todo items stored in memory.",
    "Write a C function that reverses a singly linked list in place.",
    "Write a Python class for a bank account with deposit, withdraw (no overdraft) and a balance property.",
    "Write a function in Go that counts word frequencies in a string and returns a map.",
    "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "Write an HTML page with a form that has name, email and message fields, plus basic CSS to center it.",
    "Write a Python generator that yields the prime numbers one by one, forever.",
    "Write a TypeScript interface for a blog post (title, author, tags, publishedAt) and a function that filters "
    "posts by tag.",
    "Write a Python script that walks a directory tree and prints the 10 largest files with their sizes.",
    "Write a Rust function that takes a vector of integers and returns the second largest distinct value, if any.",
    "Write a Python decorator that retries a function up to 3 times if it raises an exception, waiting 1 second "
    "between attempts.",
    "Write a Java method that checks if two strings are anagrams of each other.",
    "Write a Python function that flattens an arbitrarily nested list, e.g. [1, [2, [3, 4]], 5] -> [1, 2, 3, 4, 5].",
    "Write a shell one-liner that finds all TODO comments in .py files under the current folder and shows the file "
    "and line number.",
    "Write a Python function that validates a Sudoku board (9x9 list of lists, 0 for empty cells).",
    "Write a React component that shows a counter with increment and decrement buttons and never goes below zero.",
    "Write a Python program that simulates rolling two dice 10,000 times and prints how often each sum appears.",
    "Write a function that converts a Roman numeral string to an integer, in any language you like.",
    "Write a Python function to compute the Levenshtein distance between two strings.",
    "Write a Dockerfile for a small Python web app that uses requirements.txt and runs app.py on port 8000.",
    "Write a binary search function in Python that returns the index of the target or -1, and add a few tests.",
    "Write a Python script that fetches JSON from a URL with the requests library and handles timeouts and HTTP "
    "errors gracefully.",
    "Write a function that groups a list of words into lists of anagrams, e.g. ['eat','tea','tan','ate','nat'].",
]

SYSTEM = [   # (system prompt, user message): an app's own instructions before the user's request
    ("You are the assistant of Greenleaf Pharmacy's website. Answer questions about opening hours, prescriptions "
     "and deliveries. For medical advice, tell customers to speak with a pharmacist.",
     "Hi, can I get my repeat prescription delivered this week, and how does that work?"),
    ("You are Max, the help bot of a food delivery app. Be upbeat and brief.",
     "my order says delivered but I never got it. what do I do"),
    ("You are a support assistant for CloudNote, a note-taking app for Windows, macOS and Android.",
     "My notes stopped syncing between my laptop and my phone since yesterday."),
    ("You are an airline's virtual agent. You can explain baggage rules, check-in and rebooking policies.",
     "How many bags can I take on a domestic economy flight, and what happens if mine is overweight?"),
    ("You are a helpful assistant for a public library. Help visitors find books and explain library services.",
     "Do you have any recommendations for a teenager who loved The Hunger Games?"),
    ("You are a reading tutor for primary-school children. Be encouraging and use very simple language.",
     "what does the word 'enormous' mean?"),
    ("You are a chemistry teaching assistant for first-year university students. Explain reasoning, not just "
     "results.",
     "Why does adding salt to water raise its boiling point?"),
    ("You are a Spanish teacher. Reply in English, but include the Spanish phrases the student asks for.",
     "How do I politely ask for the bill at a restaurant in Spain?"),
    ("You are a coding assistant inside an IDE. Answer with code first, then at most three sentences.",
     "Read a CSV file with pandas and print the average of the 'price' column."),
    ("You are a DevOps assistant. Assume the user runs Ubuntu servers and prefers shell commands.",
     "How do I see which process is using port 8080?"),
    ("You are a JavaScript mentor for beginners. Explain every line you write.",
     "How do I add a click handler to a button that shows an alert?"),
    ("You review pull requests for a Python team. Be specific and constructive.",
     "Is this fine? def avg(xs): return sum(xs)/len(xs)"),
    ("You are a copywriter for a small independent coffee roastery. Warm, down-to-earth tone.",
     "Write a short product description for our new Ethiopian single-origin beans."),
    ("You are a social media manager for a yoga studio. Keep posts under 60 words and add two hashtags.",
     "Write a post announcing our new Sunday morning beginners class."),
    ("You are a speechwriter. Write in a natural spoken style with short sentences.",
     "Write a two-minute toast for my brother's wedding. He's a firefighter and loves fishing."),
    ("You help users write professional emails. Always include a subject line.",
     "Tell my landlord the kitchen tap has been leaking for a week and ask when it can be fixed."),
    ("You are a personal finance assistant. Give general guidance only, and explain trade-offs.",
     "Should I pay off my credit card or put money into savings first?"),
    ("You are a nutrition assistant. Suggest balanced, practical options and note allergies when relevant.",
     "Give me three quick high-protein breakfasts that aren't eggs."),
    ("You are a gardening expert for people with small balconies.",
     "What vegetables can I grow in pots on a shady north-facing balcony?"),
    ("You are a home repair assistant. Put safety first and say when to call a professional.",
     "My bathroom fan makes a loud rattling noise. How can I fix it?"),
    ("You are a calm, friendly companion for people who feel lonely. Listen and respond kindly.",
     "I moved here for work and most evenings I don't talk to anyone. It's getting to me."),
    ("You are a Dungeon Master running a fantasy adventure. Describe scenes vividly and end with a choice.",
     "I push open the heavy door of the abandoned watchtower."),
    ("You are a trivia host. Be playful and give a fun fact after each answer.",
     "Which planet has the most moons?"),
    ("Always answer in exactly three bullet points.",
     "What are the benefits of learning a second language?"),
    ("You are a helpful assistant. Respond only with valid JSON with the keys \"answer\" and \"confidence\".",
     "What is the capital of Australia?"),
    ("You are a meeting assistant. Produce clear, concise summaries with action items.",
     "Summarise: Ana will finish the budget draft by Friday. Tom is waiting on the vendor quote. We agreed to "
     "move the launch to 14 May. Lisa will book the venue once the date is confirmed."),
    ("You are an HR assistant for a mid-sized company. Be neutral and refer to company policy where relevant.",
     "How should I ask my manager for a day off to attend my child's school event?"),
    ("You are a travel agent specialising in rail travel in Europe.",
     "Plan a 5-day train trip from Amsterdam to Vienna with two stops on the way."),
    ("You are a careful math assistant. Show each step and box the final answer.",
     "A shirt costs $40 after a 20% discount. What was the original price?"),
    ("You are an assistant for a real estate agency. Be factual and do not give legal advice.",
     "What questions should I ask when viewing a flat to rent?"),
]

HAND_WRITTEN = {          # category -> its prompts (single user turns)
    "chat": CHAT,
    "explain": EXPLAIN,
    "howto": HOWTO,
    "writing": WRITING,
    "rewrite": REWRITE,
    "reasoning": REASONING,
    "code_instruct": CODE_INSTRUCT,
}
CATEGORIES = [*HAND_WRITTEN, "code_complete", "multiturn", "system"]   # the order of the file


# --- assembly -------------------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def hand_written_rows() -> list[dict]:
    return [{"id": f"{cat}/{i:02d}", "category": cat, "messages": [{"role": "user", "content": text}]}
            for cat, prompts in HAND_WRITTEN.items() for i, text in enumerate(prompts)]


def code_complete_rows(source: list[dict]) -> list[dict]:
    """HumanEval/k for k divisible by HUMANEVAL_EVERY, worded as in eval_prompts.jsonl."""
    keep = [r for r in source if r["id"].startswith("HumanEval/")
            and int(r["id"].split("/")[1]) % HUMANEVAL_EVERY == 0]
    return [{"id": f"code_complete/{r['id']}", "category": "code_complete", "messages": r["messages"]} for r in keep]


def multiturn_rows(source: list[dict]) -> list[dict]:
    """The MT-Bench rows of eval_prompts.jsonl (the odd ids) with the placeholder for the first answer."""
    rows = []
    for r in source:
        if not r["id"].startswith("mtbench/"):
            continue
        first, second = (m for m in r["messages"] if m["role"] == "user")
        rows.append({"id": f"multiturn/{r['id']}", "category": "multiturn",
                     "messages": [first, {"role": "assistant", "content": None}, second]})
    return rows


def system_rows() -> list[dict]:
    return [{"id": f"system/{i:02d}", "category": "system",
             "messages": [{"role": "system", "content": sys_text}, {"role": "user", "content": text}]}
            for i, (sys_text, text) in enumerate(SYSTEM)]


def build(source: Path = SOURCE) -> list[dict]:
    src = read_jsonl(source)
    return hand_written_rows() + code_complete_rows(src) + multiturn_rows(src) + system_rows()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rows = build()
    write_jsonl(rows, args.out)
    counts = {c: sum(r["category"] == c for r in rows) for c in CATEGORIES}
    print(f"wrote {len(rows)} prompts to {args.out}: " + ", ".join(f"{c} {n}" for c, n in counts.items()))


if __name__ == "__main__":
    main()
