#!/usr/bin/env python3
"""Generate tickets.csv: synthetic customer-support tickets for a fictional shop.

The shop is "Brightloom", an online store for home and desk gear that also
sells a web/app subscription ("Brightloom Plus", with Starter/Pro/Team plans).
Every ticket is composed from hand-written templates and slot fillers, so the
output is fully determined by the seed.

Usage (from the repository root):

    python projects/tickets/make_tickets.py            # writes projects/tickets/tickets.csv
    python projects/tickets/make_tickets.py --seed 7 --per-label 60 --out /tmp/t.csv

Standard library only.
"""

import argparse
import csv
import os
import random
import re

SEED = 20240611
PER_LABEL = 60
LABELS = [
    "billing",
    "shipping",
    "returns",
    "account_access",
    "technical_bug",
    "cancellation",
    "product_question",
    "feedback",
]

# ---------------------------------------------------------------------------
# Slot fillers. A slot is chosen once per ticket, so "{product}" names the same
# item everywhere in one ticket; "{product2}" is a second, independent pick.
# ---------------------------------------------------------------------------

PRODUCTS = [
    "Nimbus desk lamp",
    "Aero 2 kettle",
    "Orbit earbuds",
    "Pine standing desk",
    "Halo smart plug",
    "Tern backpack",
    "Cirrus air purifier",
    "Quill notebook set",
    "Ember travel mug",
    "Drift yoga mat",
    "Loop USB-C hub",
    "Marlow throw blanket",
    "Fathom water bottle",
    "Juniper plant pot",
    "Atlas monitor arm",
    "Sable office chair",
    "Kite phone stand",
    "Bramble candle trio",
    "Hearth cast iron pan",
    "Vela wireless charger",
]
PLANS = [
    "Pro plan",
    "Starter plan",
    "Team plan",
    "Plus membership",
    "annual Pro plan",
    "monthly Starter plan",
    "Team plan (5 seats)",
    "Plus subscription",
]
WHEN = [
    "yesterday",
    "last week",
    "three days ago",
    "on Monday",
    "this morning",
    "over the weekend",
    "last Thursday",
    "two weeks ago",
    "earlier today",
    "on the 3rd",
    "a few days ago",
    "last night",
]
DAYS = ["5", "6", "8", "10", "12", "two", "three", "four", "nine", "eleven"]
CARRIERS = ["UPS", "FedEx", "DHL", "USPS", "the courier", "Royal Mail", "DPD", "the delivery guy"]
CITIES = [
    "Leeds",
    "Portland",
    "Austin",
    "Dublin",
    "Manchester",
    "Denver",
    "Toronto",
    "Bristol",
    "Phoenix",
    "Glasgow",
    "Columbus",
    "Melbourne",
]
DEVICES = [
    "my iPhone",
    "my Android phone",
    "Chrome on Windows",
    "Safari on my Mac",
    "Firefox",
    "my iPad",
    "the desktop app",
    "Edge on my work laptop",
    "a Pixel 7",
    "the mobile app",
]
FEATURES = [
    "the export button",
    "the dashboard",
    "the search bar",
    "the wishlist",
    "the checkout page",
    "saved carts",
    "the invoice download",
    "push notifications",
    "the order history page",
    "the calendar sync",
    "the CSV import",
    "dark mode",
    "the product filters",
    "the shared workspace",
    "the reports tab",
]
ERRORS = [
    "Error 500",
    "a blank white screen",
    '"Something went wrong, please try again"',
    "error code E-402",
    "a spinner that never stops",
    '"Request timed out"',
    "a 404 page",
    '"Unexpected token in JSON"',
    "error BLM-17",
    '"Session invalid"',
]
NAMES = [
    "Sarah",
    "Tom",
    "Priya",
    "Jonas",
    "Maria G.",
    "Kev",
    "Aisha",
    "D. Walker",
    "Lena",
    "Marcus",
    "Yuki",
    "Chris",
    "Fatima",
    "Ben",
    "Olga",
    "Rob",
    "Nadia",
    "Sam",
    "Grace",
    "Luis",
]
PAYMENTS = [
    "my Visa",
    "my Mastercard",
    "PayPal",
    "my Amex",
    "Apple Pay",
    "my debit card",
    "the company card",
    "Google Pay",
]
PROMOS = ["SPRING15", "WELCOME10", "BLM20OFF", "FREESHIP", "LOYAL25", "HOLIDAY30"]
SIZES = ["small", "medium", "large", "the 140 cm one", "the XL", "the compact version"]
COLORS = ["sage green", "charcoal", "oat", "navy", "terracotta", "white", "black", "sand"]
YEARS = ["two", "three", "four", "five", "six", "several"]
EMAILS = [
    "j.smith@",
    "my old work address",
    "my gmail",
    "my university email",
    "the address I used to sign up",
    "my partner's email",
]


def _order(rng):
    style = rng.randrange(5)
    if style == 0:
        return f"#BL-{rng.randint(10000, 99999):05d}"
    if style == 1:
        return f"order {rng.randint(100, 999)}-{rng.randint(0, 9999):04d}"
    if style == 2:
        return f"BL{rng.randint(100000, 999999):06d}"
    if style == 3:
        return f"#{rng.randint(400000, 899999)}"
    return f"order no. {rng.randint(10000, 99999)}"


def _amount(rng):
    return f"${rng.randint(8, 260)}.{rng.choice(['00', '99', '49', '95', '50'])}"


SLOTS = {
    "product": PRODUCTS,
    "product2": PRODUCTS,
    "plan": PLANS,
    "when": WHEN,
    "days": DAYS,
    "carrier": CARRIERS,
    "city": CITIES,
    "device": DEVICES,
    "feature": FEATURES,
    "feature2": FEATURES,
    "error": ERRORS,
    "name": NAMES,
    "payment": PAYMENTS,
    "promo": PROMOS,
    "size": SIZES,
    "color": COLORS,
    "years": YEARS,
    "email": EMAILS,
    "last4": lambda rng: f"{rng.randint(0, 9999):04d}",
    "order": _order,
    "amount": _amount,
    "amount2": _amount,
}

# ---------------------------------------------------------------------------
# Per-label material. CORE: the main request (one sentence, sometimes two).
# DETAIL: an optional follow-up sentence that adds specifics. ASIDE: a brief,
# clearly secondary mention used when *another* label's ticket drifts topic.
# Phrasing is deliberately mixed so no single word gives the label away.
# ---------------------------------------------------------------------------

CORE = {
    "billing": [
        "I was charged twice for {order}, both for {amount}.",
        "My card statement shows {amount} from Brightloom but I only expected {amount2}.",
        "The {plan} renewed at a higher price than what I signed up for.",
        "Can you send me a proper invoice with our company VAT number for {order}?",
        "The promo code {promo} didn't come off the total at checkout and I paid full price.",
        "I switched from the {plan} to a cheaper tier but the last payment was still the old amount.",
        "There's a pending transaction of {amount} on {payment} and I never placed an order {when}.",
        "How do I update the card on file? {payment} expired and I don't want the {plan} to lapse.",
        "The receipt for {order} lists sales tax even though we're tax exempt.",
        "I got an email saying my payment failed but the money left my account.",
        "Why did I get billed {amount} {when}? I thought the free trial ran for another week.",
        "Our finance team needs all of last year's invoices in one PDF, is that possible?",
        "You took {amount} for the {product} but the price on the site was lower when I ordered.",
        "I was supposed to get a price adjustment of {amount} after the sale, it never showed up on {payment}.",
        "The checkout added a {amount} service fee that wasn't mentioned anywhere.",
        "Please move the {plan} payments from {payment} to PayPal.",
    ],
    "shipping": [
        "Where is my {order}? Tracking hasn't moved in {days} days.",
        "The {product} was meant to arrive {days} days ago and it's still not here.",
        "Tracking says delivered but there's nothing at my door, and the neighbours haven't seen a parcel either.",
        "I need to change the delivery address on {order}, I've moved to {city}.",
        "Do you ship to {city}? The checkout won't let me pick it.",
        "{carrier} left a note saying they couldn't deliver, how do I rebook?",
        "My parcel is stuck at the depot in {city} and nobody can tell me when it'll go out.",
        "I paid for express delivery on {order} and it's taken {days} days so far.",
        "Only half of my order turned up, the {product2} is missing from the box.",
        "The tracking link in the confirmation email for {order} just says 'label created'.",
        "Can I pick up the {product} from a locker instead of home delivery? I'm never in during the day.",
        "Is there any way to get the {product} by Friday? It's a birthday present.",
        "The {product} shows as 'in transit' for over a week now with {carrier}.",
        "{carrier} says the address on {order} is incomplete, can you add the flat number?",
        "When will {order} be dispatched? It's been 'processing' since {when}.",
    ],
    "returns": [
        "I'd like to send back the {product}, it's not what I expected.",
        "The {product} arrived with a cracked base. Can I get a replacement?",
        "How do I get a prepaid label to return {order}?",
        "Can I exchange the {product} in {color} for a different colour?",
        "I sent the {product} back {when} and haven't heard anything since, has it been received?",
        "The {product} is the wrong size, can I swap it for {size}?",
        "Is it too late to return something I bought {days} weeks ago? It's unopened.",
        "You sent me a {product2} instead of the {product} I ordered, how do I send it back?",
        "The return portal says {order} isn't eligible, but it's well within 30 days.",
        "I dropped off the return for {order} at the post office, when will the money be back on {payment}?",
        "The {product} stopped working after a week. I want to return it, not get it repaired.",
        "Can I return just one item from {order} and keep the rest?",
        "The box for the {product} was opened, can I still send it back if everything's inside?",
        "Where do I ship the {product} back to? The slip in the box has no address.",
        "It was a gift and the person already has one, can they exchange the {product} without a receipt?",
    ],
    "account_access": [
        "I can't log in, it keeps saying my password is wrong even after I reset it.",
        "The password reset email never arrives, I've checked spam.",
        "My account is locked after too many attempts, how long until I can get back in?",
        "I lost my phone and now can't get the two-factor code to sign in.",
        "I signed up with {email} which I no longer have access to, how can I get into my account?",
        "Someone changed the email on my account {when} and I didn't do it.",
        "The login page just loops me back to the sign-in screen on {device}.",
        "Our team admin left the company and nobody can get into the Team workspace settings now.",
        "Sign in with Google stopped working for me, it says the account doesn't exist.",
        "I think my account has been hacked, there are orders I didn't place.",
        "The verification code expires before the SMS even arrives.",
        "How do I change the email I log in with? I'm locked out of the old one.",
        "It says 'no account found' for my email even though I've ordered from you for {years} years.",
        "I can't get past the 'verify it's you' step, it never accepts the code.",
        "My colleague invited me to the Team plan but the invite link says it's expired.",
    ],
    "technical_bug": [
        "{feature} shows {error} every time I click it.",
        "The app crashes as soon as I open {feature} on {device}.",
        "I keep getting {error} when I try to check out.",
        "Since the update {when}, {feature} doesn't load at all.",
        "The {product} page shows the wrong price and then {error} when I add it to the basket.",
        "{feature} is broken on {device}, buttons do nothing when tapped.",
        "Images on the product pages won't load, just grey boxes.",
        "The CSV export from the reports tab comes out with all the columns shifted.",
        "Every time I save changes in {feature}, they disappear after a refresh.",
        "The site freezes on {device} when I scroll through the {product} reviews.",
        "Notifications keep firing for an order that was delivered weeks ago.",
        "The filters on the search results page reset themselves when I go to page 2.",
        "I get {error} uploading a photo to my review, tried three different images.",
        "The {plan} dashboard shows zero usage even though we used it all month.",
        "{feature} works on desktop but on {device} it's completely blank.",
        "The calendar sync duplicated every event twice after the last release.",
    ],
    "cancellation": [
        "Please cancel {order}, I ordered the wrong thing by mistake.",
        "I want to stop my {plan} from renewing next month.",
        "How do I close my {plan}? I can't find the option anywhere.",
        "Can you cancel the {product} from {order} before it ships? I found it cheaper elsewhere.",
        "I'd like to end our Team subscription at the end of this billing period.",
        "Please don't send {order}, I no longer need it.",
        "I'm done with the {plan}, please turn off auto-renew and confirm.",
        "I placed {order} {when} and changed my mind, is it still possible to stop it?",
        "We're moving to another tool, so please terminate our workspace and the {plan}.",
        "Can I pause the {plan} for two months instead of quitting entirely?",
        "I clicked cancel on the subscription page but it still says active, please make sure it's stopped.",
        "Kindly delete my account and stop any future charges on the {plan}.",
        "I accidentally ordered the {product} twice, please call off the second order.",
        "Don't want to continue after the trial, please make sure I'm not rolled onto the {plan}.",
        "Is it too late to stop {order}? The status still says processing.",
    ],
    "product_question": [
        "Does the {product} work with a UK plug or do I need an adapter?",
        "What are the exact dimensions of the {product}? I'm not sure it'll fit on my desk.",
        "Is the {product} coming back in {color}? It's been out of stock for ages.",
        "Can the {product} be used with the {product2}?",
        "Is the {product} dishwasher safe?",
        "What's the difference between the {product} and the newer model?",
        "How long does the battery on the {product} last on a full charge?",
        "Does the {plan} include the shared workspace or is that only on the Team plan?",
        "Is the {product} suitable for someone who is 6'4\"?",
        "What material is the {product} made from? I have a latex allergy.",
        "Does the {product} come with a warranty, and for how long?",
        "Can I use the {plan} on more than one computer?",
        "Is the {color} {product} the same shade as in the photos or more muted?",
        "How many people can share one {plan}?",
        "Does the {product} need assembly, and if so, roughly how long does it take?",
        "Will you be restocking the {product} in {size} before the holidays?",
    ],
    "feedback": [
        "Just wanted to say the {product} is brilliant, best purchase this year.",
        "The new checkout is so much faster, well done to whoever built it.",
        "It would be great if the app had a dark mode, my eyes would thank you.",
        "The packaging on {order} was way more than needed, please consider less plastic.",
        "Your support agent {name} was incredibly helpful {when}, please pass on my thanks.",
        "I love the {plan} but the reports could do with a weekly summary email.",
        "Honestly the {product} is a bit disappointing compared to the photos, just letting you know.",
        "Suggestion: let us save more than one delivery address.",
        "The recent redesign made the menu harder to find things in, I preferred the old layout.",
        "Been using Brightloom for {years} years and it keeps getting better, keep it up.",
        "The {product} is lovely but the instructions were confusing, maybe add pictures.",
        "Would be nice to have a loyalty scheme for regulars.",
        "The music on your phone line hold is awful, please change it!",
        "Small thing, but the {color} option looks completely different on screen than in person.",
        "Really impressed with how quickly {order} arrived, and the note in the box was a nice touch.",
        "It would help if the {plan} had an option to export everything at once.",
    ],
}

DETAIL = {
    "billing": [
        "I've attached a screenshot of the statement.",
        "The card ends in {last4}.",
        "Can you refund the difference?",
        "It shows up as BRIGHTLOOM*PLUS on the statement.",
        "My accountant needs this sorted by the end of the month.",
        "I only have one active subscription as far as I know.",
        "The amount was {amount} in total.",
    ],
    "shipping": [
        "The reference is {order}.",
        "I'm in {city} if that matters.",
        "{carrier} customer service told me to contact you.",
        "I've been home all day waiting.",
        "The estimated date has already changed twice.",
        "I've already checked the tracking page twice today.",
        "I need it before I travel next week.",
    ],
    "returns": [
        "I still have all the original packaging.",
        "The order number is {order}.",
        "I'd prefer the money back rather than store credit.",
        "I can send photos if that helps.",
        "It was bought {when}.",
        "Happy to pay for the postage if that's the rule.",
        "The label printer at home is broken, can I get a QR code instead?",
    ],
    "account_access": [
        "I'm using {device}.",
        "I've tried clearing cookies and a different browser.",
        "I need to get in to download an invoice urgently.",
        "My username should be the same email I'm writing from.",
        "I can verify my identity with the last order number, {order}.",
        "It was working fine {when}.",
    ],
    "technical_bug": [
        "This happens on {device}.",
        "I've cleared the cache and reinstalled, same result.",
        "It started {when}.",
        "Happy to send a screen recording.",
        "My colleague has the same problem on a different machine.",
        "It was fine before the last update.",
        "Steps: open it, click once, wait a few seconds, and it fails.",
    ],
    "cancellation": [
        "Please confirm by email once it's done.",
        "It was placed {when}.",
        "I'd like the refund to go back to {payment}.",
        "I don't want any more emails about it either.",
        "My account email is the one I'm writing from.",
        "No need for a retention offer, thanks.",
    ],
    "product_question": [
        "I'm thinking of ordering two.",
        "The listing doesn't say.",
        "It's going to be a gift so I want to get it right.",
        "I couldn't find it in the FAQ.",
        "I'd order today if so.",
        "My last one from a different brand was a disaster.",
    ],
    "feedback": [
        "No reply needed, just wanted you to know.",
        "Otherwise everything has been great.",
        "I've recommended you to a few friends already.",
        "Not a complaint as such, just an observation.",
        "Hope this is useful.",
        "Other shops do this and it makes a big difference.",
    ],
}

ASIDE = {
    "billing": [
        "Also, separately, the last invoice had my old address on it.",
        "On a side note, I was charged the usual {amount} this month, which is fine.",
    ],
    "shipping": [
        "Also the last parcel took ages to arrive, but it got here in the end.",
        "Side note: the courier was very nice.",
    ],
    "returns": [
        "I returned something else last month and that went fine.",
        "(I may also send back the {product2} later, but that's a separate thing.)",
    ],
    "account_access": [
        "I also had to reset my password to write this, which was a pain.",
        "Also, the site logged me out twice while I was typing this.",
    ],
    "technical_bug": [
        "The app was also a bit slow today, not sure if related.",
        "Also, the search bar seems glitchy lately but that's minor.",
    ],
    "cancellation": [
        "I was thinking of cancelling the {plan} altogether but I'll give it another month.",
        "Not cancelling anything, just want this fixed.",
    ],
    "product_question": [
        "Also, does the {product2} come in {color}? Just curious.",
        "Unrelated, but is the {product2} back in stock soon?",
    ],
    "feedback": [
        "Apart from this, I love the shop.",
        "Your new website looks great by the way.",
    ],
}

GREETINGS = [  # informal ones run on in lower case ("Hi, where is ...")
    "Hi,",
    "Hello,",
    "Hi there,",
    "Hey,",
    "Good morning,",
    "Hi team,",
    "Hiya,",
    "Hey guys,",
    "Good afternoon,",
    "Hi support,",
    "Hello!",
    "Hi!",
]
FORMAL_GREETINGS = [  # letter style: next sentence keeps its capital
    "Dear Brightloom,",
    "Hello Brightloom support,",
    "To whom it may concern,",
    "Dear support team,",
]
# Sentence starts that must keep their capital after "Hi,".
_KEEP_CAPS = {"I", "I'm", "I've", "I'd", "I'll", "Royal", "Brightloom", "DHL", "DPD", "UPS", "USPS"}
OPENERS = [
    "I hope you can help.",
    "Quick question.",
    "Second time writing about this.",
    "I've been a customer for {years} years.",
    "Sorry to bother you.",
    "Bit of an issue here.",
    "Not sure who to ask about this.",
]
CLOSINGS = {
    "neutral": [
        "Thanks.",
        "Thanks in advance.",
        "Cheers.",
        "Many thanks.",
        "Appreciate it.",
        "Thank you!",
        "Let me know.",
        "Thanks for your help.",
    ],
    "upset": [
        "This is really frustrating.",
        "Please sort this out ASAP.",
        "Not happy at all.",
        "I expected better from you.",
        "This is the third time I've asked!!",
        "Very annoyed right now.",
        "Please help, I'm getting nowhere.",
        "I'd appreciate a quick reply.",
    ],
    "warm": [
        "Thanks so much!",
        "You guys are great.",
        "Have a lovely day!",
        "Keep up the good work.",
        "Thanks again :)",
    ],
}
# Which closing moods fit which label (feedback and questions are rarely angry).
MOODS = {
    "billing": ["neutral", "upset", "upset"],
    "shipping": ["neutral", "upset", "upset"],
    "returns": ["neutral", "neutral", "upset"],
    "account_access": ["neutral", "upset", "upset"],
    "technical_bug": ["neutral", "upset"],
    "cancellation": ["neutral", "neutral", "upset"],
    "product_question": ["neutral", "warm"],
    "feedback": ["warm", "neutral", "warm"],
}
SIGNOFFS = [
    "- {name}",
    "{name}",
    "Regards, {name}",
    "Thanks, {name}",
    "Best, {name}",
    "Sent from my phone",
]

_SLOT_RE = re.compile(r"\{(\w+)\}")


def _fill(rng, template, chosen):
    def repl(m):
        key = m.group(1)
        if key not in chosen:
            src = SLOTS[key]
            chosen[key] = src(rng) if callable(src) else rng.choice(src)
        return chosen[key]

    text = _SLOT_RE.sub(repl, template)
    return text[:1].upper() + text[1:]


def _n_sentences(text):
    return len(re.findall(r"[.!?]+(?=\s|$)", text.replace("no. ", "no ")))


def _run_on(text):
    first = text.split(" ", 1)[0]
    if first in _KEEP_CAPS or first.rstrip(",") in _KEEP_CAPS or first.isupper():
        return text
    return text[:1].lower() + text[1:]


def _typo_word(rng, word):
    letters = [i for i, c in enumerate(word) if c.isalpha()]
    if len(letters) < 4 or any(c.isdigit() for c in word):
        return word
    i = rng.choice(letters[1:-1])
    op = rng.randrange(3)
    if op == 0:  # swap with next letter
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if op == 1:  # drop a letter
        return word[:i] + word[i + 1 :]
    return word[:i] + word[i] + word[i:]  # double a letter


def _roughen(rng, text):
    """Occasional typos and casual writing, like real tickets."""
    if rng.random() < 0.18:
        words = text.split(" ")
        for _ in range(rng.choice([1, 1, 2])):
            j = rng.randrange(len(words))
            words[j] = _typo_word(rng, words[j])
        text = " ".join(words)
    r = rng.random()
    if r < 0.07:
        text = text.lower()
    elif r < 0.12:
        text = re.sub(r"\bI\b", "i", text)
    if rng.random() < 0.08:
        text = text.rstrip(".")
    return text


def make_ticket(rng, label):
    chosen = {}
    parts = []
    greeting = None
    r = rng.random()
    if r < 0.5:
        greeting = rng.choice(GREETINGS)
    elif r < 0.6:
        greeting = rng.choice(FORMAL_GREETINGS)
    if greeting:
        parts.append(greeting)
    sentences = []  # at most 4, core first unless there is an opener
    if rng.random() < 0.12:
        sentences.append(_fill(rng, rng.choice(OPENERS), chosen))
    sentences.append(_fill(rng, rng.choice(CORE[label]), chosen))
    extras = rng.choices([0, 1, 2, 3], weights=[3, 4, 3, 1])[0]
    pool = []
    if rng.random() < 0.55:
        pool.append(("detail", None))
    if rng.random() < 0.25:
        other = rng.choice([lab for lab in LABELS if lab != label])
        pool.append(("aside", other))
    pool.append(("closing", None))
    for kind, other in pool[:extras]:
        if kind == "detail":
            extra = _fill(rng, rng.choice(DETAIL[label]), chosen)
        elif kind == "aside":
            extra = _fill(rng, rng.choice(ASIDE[other]), chosen)
        else:
            extra = rng.choice(CLOSINGS[rng.choice(MOODS[label])])
        if _n_sentences(" ".join(sentences + [extra])) > 4:
            break
        sentences.append(extra)
    if greeting in GREETINGS and greeting.endswith(","):
        sentences[0] = _run_on(sentences[0])
    parts.extend(sentences)
    if rng.random() < 0.3:
        parts.append(_fill(rng, rng.choice(SIGNOFFS), chosen))
    return _roughen(rng, " ".join(parts))


def generate(seed=SEED, per_label=PER_LABEL):
    rng = random.Random(seed)
    seen = set()
    rows = []
    for label in LABELS:
        count, tries = 0, 0
        while count < per_label:
            tries += 1
            if tries > per_label * 200:
                raise RuntimeError(f"cannot make {per_label} distinct tickets for {label}")
            text = make_ticket(rng, label)
            key = text.lower()
            if key in seen:
                continue
            seen.add(key)
            rows.append((text, label))
            count += 1
    rng.shuffle(rows)
    return rows


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--per-label", type=int, default=PER_LABEL)
    ap.add_argument("--out", default=os.path.join(here, "tickets.csv"))
    args = ap.parse_args()

    rows = generate(args.seed, args.per_label)
    texts = [t for t, _ in rows]
    assert len(set(texts)) == len(texts), "duplicate ticket text"
    assert all("\n" not in t and t.strip() for t in texts)
    with open(args.out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["text", "label"])
        w.writerows(rows)
    counts = {lab: sum(1 for _, x in rows if x == lab) for lab in LABELS}
    print(f"wrote {len(rows)} rows to {args.out}")
    for lab in LABELS:
        print(f"  {lab:<17} {counts[lab]}")


if __name__ == "__main__":
    main()
