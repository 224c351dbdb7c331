"""Source texts of the input-grounded prompt set (benchmarks/prompts/grounded.jsonl): each task gives a text and asks
for it back copied with a small change, corrected, converted or summarized. Written for this project (Apache-2.0)."""

from __future__ import annotations

# (name, kind, instruction, text); kind "copy": the answer is about as long as the text, "summary": much shorter.
# Code comes in a fenced block with the instruction after it (SmolLM2-135M then writes the code back; asked first, it
# often answered with the instruction or a description), other texts after the instruction.
TASKS: list[tuple[str, str, str, str]] = [
    (
        "code_rename_variable",
        "copy",
        "Rename the variable `total` to `subtotal` everywhere in this Python code. Output the complete updated code.",
        '''```python
def order_total(items, tax_rate=0.08, discount=None):
    """Return the amount to charge for a list of (name, price, quantity) items."""
    total = 0.0
    for name, price, quantity in items:
        if quantity <= 0:
            raise ValueError(f"bad quantity for {name}: {quantity}")
        total += price * quantity
    if discount is not None:
        total -= total * discount
    tax = total * tax_rate
    return round(total + tax, 2)


def print_receipt(items, tax_rate=0.08):
    total = order_total(items, tax_rate)
    for name, price, quantity in items:
        print(f"{name:<20} {quantity:>3} x {price:>8.2f}")
    print(f"{'TOTAL':<20} {total:>14.2f}")
```''',
    ),
    (
        "code_change_default",
        "copy",
        "Change the default `timeout` from 30 to 60 seconds in this code and keep everything else the same. "
        "Output the whole code.",
        '''```python
import time
import urllib.request


def fetch(url, timeout=30, retries=3, backoff=2.0):
    """Download a page, retrying on errors with exponential backoff."""
    delay = 1.0
    for attempt in range(1, retries + 1):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.read().decode("utf-8")
        except OSError as error:
            if attempt == retries:
                raise
            print(f"attempt {attempt} failed: {error}; retrying in {delay:.1f}s")
            time.sleep(delay)
            delay *= backoff
    return None
```''',
    ),
    (
        "code_rename_class",
        "copy",
        "Rename the class `Cart` to `ShoppingCart` in this code. Output the full code with the new name.",
        """```python
class Cart:
    def __init__(self, owner):
        self.owner = owner
        self.items = {}

    def add(self, product, quantity=1):
        self.items[product] = self.items.get(product, 0) + quantity

    def remove(self, product):
        if product in self.items:
            del self.items[product]

    def count(self):
        return sum(self.items.values())

    def __repr__(self):
        return f"Cart(owner={self.owner!r}, items={self.items!r})"


cart = Cart("alice")
cart.add("apple", 3)
cart.add("bread")
print(cart.count())
```""",
    ),
    (
        "code_js_rename_function",
        "copy",
        "Rename the function `formatDate` to `formatIsoDate` in this JavaScript code, including where it is "
        "called. Output the complete code.",
        """```javascript
function formatDate(date) {
  const year = date.getFullYear();
  const month = String(date.getMonth() + 1).padStart(2, "0");
  const day = String(date.getDate()).padStart(2, "0");
  return `${year}-${month}-${day}`;
}

function daysBetween(start, end) {
  const msPerDay = 24 * 60 * 60 * 1000;
  return Math.round((end - start) / msPerDay);
}

function describeTrip(start, end) {
  const days = daysBetween(start, end);
  return `Trip from ${formatDate(start)} to ${formatDate(end)} (${days} days)`;
}

console.log(describeTrip(new Date(2024, 5, 1), new Date(2024, 5, 15)));
```""",
    ),
    (
        "code_sql_table",
        "copy",
        "Rewrite this SQL query so that it reads from the table `orders_2024` instead of `orders`. Keep the rest "
        "of the query as it is.",
        """```sql
SELECT
    customers.id,
    customers.name,
    customers.city,
    COUNT(orders.id) AS order_count,
    SUM(orders.amount) AS total_amount,
    MAX(orders.created_at) AS last_order
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.status = 'shipped'
  AND orders.amount > 0
GROUP BY customers.id, customers.name, customers.city
HAVING COUNT(orders.id) >= 3
ORDER BY total_amount DESC
LIMIT 20;
```""",
    ),
    (
        "code_add_comment",
        "copy",
        "Add a short comment above each function in this Python code explaining what it does. Output the "
        "complete code.",
        """```python
def celsius_to_fahrenheit(celsius):
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit):
    return (fahrenheit - 32) * 5 / 9


def average(values):
    if not values:
        return 0.0
    return sum(values) / len(values)


def warmest_day(readings):
    best_day, best_temp = None, None
    for day, temp in readings.items():
        if best_temp is None or temp > best_temp:
            best_day, best_temp = day, temp
    return best_day
```""",
    ),
    (
        "text_replace_name",
        "copy",
        "Repeat the following story exactly, but replace the name Anna with Maria everywhere.",
        "Anna woke up early on Saturday because the sun was shining through her window. She made a cup of tea, "
        "put on her old boots and walked down to the river behind the village. The water was high after a week "
        "of rain, and the ducks were swimming close to the bank. Anna sat on a flat stone and watched them for "
        "a long time. Her neighbour, Mr. Ellis, came by with his dog and asked if she had seen the new bridge. "
        "Anna said she had not, so they walked together to the end of the path. The bridge was made of light "
        "wood and had a green rail. Anna crossed it twice, laughing, and then went home to write a letter to "
        "her brother about the river, the ducks and the new bridge.",
    ),
    (
        "text_replace_ingredient",
        "copy",
        "Repeat this recipe, but use olive oil instead of butter everywhere it appears.",
        "Roasted vegetables with herbs (serves four)\n\n"
        "1. Heat the oven to 200 degrees Celsius.\n"
        "2. Cut two carrots, one red pepper, one courgette and one red onion into pieces of the same size.\n"
        "3. Melt three tablespoons of butter in a small pan.\n"
        "4. Put the vegetables in a large baking tray and pour the melted butter over them.\n"
        "5. Add salt, black pepper, a teaspoon of dried thyme and two crushed garlic cloves.\n"
        "6. Mix everything with your hands so that each piece is coated with butter.\n"
        "7. Roast for 35 minutes, turning the vegetables once halfway through.\n"
        "8. Serve warm with rice or fresh bread, with a little extra butter on top if you like.",
    ),
    (
        "text_replace_colour",
        "copy",
        "Repeat this product description with the colour changed from blue to green. Everything else must stay "
        "the same.",
        "The Trailmate backpack is a light and strong bag for day hikes and city trips. It is made of a water "
        "resistant blue fabric with blue zips and a blue rain cover that folds into the bottom pocket. The main "
        "compartment holds 24 litres and has a padded sleeve for a laptop up to 15 inches. Two side pockets "
        "carry water bottles, and the front pocket has small sections for keys, a phone and a map. The shoulder "
        "straps are padded and can be adjusted, and a chest strap keeps the load steady on rough paths. The "
        "back panel has air channels so that you stay cool. The Trailmate weighs 850 grams and comes with a "
        "two year warranty.",
    ),
    (
        "text_change_date",
        "copy",
        "Repeat this notice, changing the date from Tuesday, March 4 to Thursday, March 6. Do not change "
        "anything else.",
        "Notice to all staff\n\n"
        "The quarterly planning meeting will take place on Tuesday, March 4 at 10:00 in the large meeting room "
        "on the second floor. Each team lead should bring a one page summary of the last quarter and a list of "
        "three goals for the next one. Coffee and sandwiches will be served at noon. If you cannot attend on "
        "Tuesday, March 4, please tell Sarah Jones in the office by Friday so that she can arrange a video call. "
        "The meeting room will be closed for cleaning on the morning before, so please do not leave any "
        "equipment there.\n\n"
        "Thank you,\nThe Operations Team",
    ),
    (
        "text_change_city",
        "copy",
        "Repeat this travel plan, but change the city Lisbon to Porto in every line.",
        "Day 1: Arrive in Lisbon in the afternoon and check in at the hotel near the old town.\n"
        "Day 1 evening: Walk along the river in Lisbon and have dinner at a small fish restaurant.\n"
        "Day 2: Take the tram to the castle in Lisbon and visit the museum of tiles.\n"
        "Day 2 evening: Listen to live music in a cafe in the centre of Lisbon.\n"
        "Day 3: Join a cooking class in Lisbon and learn to make custard tarts.\n"
        "Day 3 evening: Watch the sunset from a viewpoint above Lisbon.\n"
        "Day 4: Buy gifts at the market in Lisbon and take the train to the airport.",
    ),
    (
        "text_fix_spelling",
        "copy",
        "Correct the spelling mistakes in this paragraph and write out the corrected paragraph.",
        "Our libary will be closed next week becuase we are instaling new shelfs and a beter heating sistem. "
        "During this time you can still return books using the box next to the main enterance. Books that are "
        "due while the libary is closed will not get a late fee. The childrens corner will also get new "
        "carpets and some comfortable chairs for parents. We are sory for the trouble and we hope you will "
        "enjoy the new look when we open again on Monday morning. If you have any questions, plese send an "
        "email to the front desk or leave a mesage on our answering machine.",
    ),
    (
        "text_fix_capitals",
        "copy",
        "Fix the capitalization in this list so that every sentence starts with a capital letter and names are "
        "capitalized. Output the corrected list.",
        "- the garden club meets every first monday of the month at the town hall.\n"
        "- new members should speak to peter brown before the meeting starts.\n"
        "- this spring we will plant tomatoes, beans and sunflowers near the school.\n"
        "- the plant sale is on saturday, april 12, from nine until one.\n"
        "- please bring your own gloves, a small spade and a bottle of water.\n"
        "- children are welcome, but they must stay with an adult at all times.\n"
        "- questions about the club can be sent to linda green at the library.",
    ),
    (
        "text_fix_grammar",
        "copy",
        "Correct the grammar in this text and output the corrected text.",
        "Last summer me and my sister goes to the mountains for a week. We was staying in a small cabin near a "
        "lake. Every morning we walks to the village to buy fresh bread and milk. The people there was very "
        "friendly and they always asks us where we come from. One day it rain all day, so we stays inside and "
        "plays cards. On the last evening we cooks fish that my sister have caught in the lake. It were the "
        "best meal of the whole trip, and we promises each other to come back next year.",
    ),
    (
        "email_readdress",
        "copy",
        "Rewrite this email so that it is addressed to Daniel instead of Mark and signed by Priya instead of "
        "Tom. Keep the rest of the text.",
        "Hi Mark,\n\n"
        "Thank you for sending the draft of the report on Friday. I read it over the weekend and I think it is "
        "in good shape. The section on customer feedback is clear, and the charts make the main points easy to "
        "follow. I have two small requests. First, could you add the numbers from the March survey to the table "
        "on page four? Second, the summary at the start is a little long, so it would help to cut it to one "
        "paragraph. If you can send the new version by Wednesday, I will share it with the rest of the team "
        "before our meeting on Thursday.\n\n"
        "Best regards,\nTom",
    ),
    (
        "email_formal",
        "copy",
        "Rewrite this email in a more polite and formal tone. Keep all the facts.",
        "Hey,\n\n"
        "The printer on the third floor is broken again. It has been like this since Monday and nobody fixed "
        "it. We have to walk down to the first floor every time we need to print something, which takes ages. "
        "Also the paper tray on that one is always empty. Can someone from IT come and look at it today? We "
        "have a big client presentation on Friday and we need to print about two hundred pages for it. Let me "
        "know when you can come.\n\n"
        "Thanks,\nJamie",
    ),
    (
        "email_update_details",
        "copy",
        "Repeat this invitation, but change the time from 7 pm to 6:30 pm and the place from the Blue Door "
        "restaurant to the Harbour Cafe.",
        "Dear friends,\n\n"
        "We are happy to invite you to a small dinner to celebrate our tenth wedding anniversary. The dinner "
        "will be held at the Blue Door restaurant on Saturday, June 14, at 7 pm. There will be a set menu with "
        "a vegetarian option, and the restaurant has kindly agreed to bake a cake for us. Please let us know by "
        "the end of May if you can come, and tell us if you have any allergies. The Blue Door restaurant is a "
        "short walk from the train station, and there is free parking behind the building. We really hope to "
        "see you there.\n\n"
        "With love,\nEmma and James",
    ),
    (
        "json_to_yaml",
        "copy",
        "Convert this JSON record to YAML. Output only the YAML.",
        """{
  "id": 4821,
  "name": "Greenfield Community Garden",
  "address": {"street": "12 Orchard Lane", "city": "Millbrook", "postcode": "MB4 7QT"},
  "open": true,
  "opening_hours": {"weekdays": "08:00-18:00", "weekends": "09:00-16:00"},
  "plots": 36,
  "plots_free": 4,
  "fee_per_year": 45.0,
  "facilities": ["tool shed", "water taps", "compost bins", "greenhouse"],
  "contact": {"name": "Helen Carter", "email": "helen.carter@example.org", "phone": "555-0142"}
}""",
    ),
    (
        "json_to_list",
        "copy",
        "Turn this JSON record into a bulleted list with one line per field, written as `- field: value`.",
        """{
  "title": "The Silent Harbour",
  "author": "R. M. Castell",
  "year": 2019,
  "pages": 312,
  "genre": "mystery",
  "language": "English",
  "publisher": "Northlight Books",
  "isbn": "978-0-000-00000-0",
  "format": "paperback",
  "price": 12.99,
  "in_stock": true,
  "rating": 4.3,
  "series": "Harbour Town Mysteries",
  "series_number": 2
}""",
    ),
    (
        "csv_to_table",
        "copy",
        "Convert this CSV data to a markdown table with a header row.",
        "city,country,population_millions,area_km2,founded\n"
        "Auckland,New Zealand,1.7,1086,1840\n"
        "Bergen,Norway,0.3,465,1070\n"
        "Cordoba,Argentina,1.5,576,1573\n"
        "Dakar,Senegal,1.4,83,1857\n"
        "Edinburgh,United Kingdom,0.5,264,1124\n"
        "Fukuoka,Japan,1.6,343,1889\n"
        "Graz,Austria,0.3,128,1128\n"
        "Hobart,Australia,0.3,1696,1804",
    ),
    (
        "list_to_numbered",
        "copy",
        "Rewrite these steps as a numbered list, keeping the wording of every step.",
        "Steps to set up the new office laptop:\n"
        "* Unpack the laptop and connect the power cable.\n"
        "* Press the power button and wait for the welcome screen.\n"
        "* Choose your language and connect to the office wireless network.\n"
        "* Sign in with the user name and password from your welcome letter.\n"
        "* Change your password when the system asks you to.\n"
        "* Open the software centre and install the mail and calendar apps.\n"
        "* Check that the printer on your floor appears in the list of devices.\n"
        "* Restart the laptop once all updates are installed.",
    ),
    (
        "summary_meeting_notes",
        "summary",
        "Summarize these meeting notes in five short bullet points.",
        "Project Kestrel weekly meeting, notes\n\n"
        "Attendees: Ravi (project lead), Olga (design), Ben (backend), Chloe (testing), Marta (customer support).\n\n"
        "Ravi opened the meeting by reviewing the timeline. The beta release is still planned for the end of "
        "next month, but the payment feature is one week behind because the bank's test system was down for "
        "three days. Ben said the backend work for payments is now unblocked and he expects to finish the main "
        "parts by Friday. He asked for one more day of help from another developer to write the data migration.\n\n"
        "Olga showed the new design of the sign-up screens. The team liked the shorter form, which now asks for "
        "an email and a password only, with the rest of the profile filled in later. Chloe asked that the error "
        "messages be tested with screen readers before the beta, and Olga agreed to add this to her list.\n\n"
        "Chloe reported that automated tests now cover about seventy percent of the backend code. Two tests fail "
        "from time to time because they depend on the clock; she will rewrite them this week. Marta shared the "
        "top three questions from early users: how to reset a password, how to export data, and whether the app "
        "works offline. The team agreed that the help pages should answer all three before the beta.\n\n"
        "Action items: Ben to finish payments by Friday; Ravi to find a second developer for the migration; "
        "Olga to test error messages with screen readers; Chloe to fix the clock-dependent tests; Marta to "
        "draft the three help pages. Next meeting: Tuesday at 10:00.",
    ),
    (
        "summary_article",
        "summary",
        "Summarize this article in three or four sentences.",
        "Many towns are turning old railway lines into paths for walking and cycling. When trains stop running "
        "on a branch line, the tracks are often removed, but the land stays in one long and gentle strip that "
        "connects villages and towns. Because trains cannot climb steep hills, these routes are nearly flat, "
        "which makes them easy for families, older people and wheelchair users.\n\n"
        "The first projects of this kind began more than forty years ago, and today there are thousands of "
        "kilometres of such paths in Europe and North America. Local councils usually buy the land from the "
        "railway company and then lay a hard surface of gravel or asphalt. Old stations are sometimes turned "
        "into cafes, small museums or bike repair shops, and the bridges and tunnels are kept as part of the "
        "route.\n\n"
        "Supporters say the paths bring visitors to small places that had lost their trains, and that they give "
        "people a safe way to travel to school or work without a car. Studies in several countries have found "
        "that shops near a popular path earn more during the summer. Some farmers and home owners along the "
        "routes were worried at first about noise and litter, but most of these concerns faded once the paths "
        "were open and managed well.\n\n"
        "There are also challenges. Keeping the surface in good condition costs money every year, and some "
        "routes are broken where a section of the old line was sold or built on. In a few places, railway "
        "companies want to bring trains back, which can lead to long debates about whether the land should be "
        "used for rail or for walking and cycling.",
    ),
    (
        "summary_support_thread",
        "summary",
        "Summarize this support conversation: what was the problem, what was tried, and how was it solved?",
        "Customer (09:12): Hello, since yesterday I cannot log in to my account on the mobile app. It says "
        "'session expired' every time, even right after I type my password.\n"
        "Agent (09:15): Sorry to hear that. Could you tell me which phone and which version of the app you use?\n"
        "Customer (09:18): It is an Android phone, and the app version is 5.2.0.\n"
        "Agent (09:20): Thank you. Please try to log out on the website, then close the app completely and "
        "open it again.\n"
        "Customer (09:31): I did that, but I still get the same message.\n"
        "Agent (09:33): Could you check the date and time settings on your phone? The login can fail if the "
        "phone clock is wrong.\n"
        "Customer (09:40): The clock was set by hand and it was about twenty minutes fast. I switched it to "
        "automatic time.\n"
        "Agent (09:41): Great. Please try to log in once more.\n"
        "Customer (09:44): It works now! Thank you very much.\n"
        "Agent (09:45): You are welcome. We will add a clearer error message for this case in the next version "
        "of the app. Have a nice day.",
    ),
]

# Free-form chat questions, nothing to copy from: where n-gram speculation finds few drafts.
CHAT: list[str] = [
    "Write a short poem about the first snow of winter.",
    "Give me five ideas for a birthday party for a seven year old.",
    "Why is the sky blue? Explain it simply.",
    "What are some good habits for studying a new language?",
    "Tell me a short story about a robot who learns to paint.",
    "How do I make a simple tomato soup?",
    "What should I pack for a weekend camping trip?",
    "Explain what a computer network is to someone who has never used one.",
    "Give me three tips for sleeping better.",
    "Describe a perfect day at the beach.",
    "What is the difference between weather and climate?",
    "Write a friendly message inviting my neighbours to a street party.",
    "How can I save money on groceries each week?",
    "What are the main parts of a plant and what do they do?",
    "Suggest a plan for a one hour workout at home without equipment.",
    "Why do people keep diaries? Give a few reasons.",
]
