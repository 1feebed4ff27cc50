"""Fixed English prose that benchmark prompts are cut from (written for this package, so every
checkout tokenizes exactly the same text and workloads are reproducible)."""

CORPUS = """\
The harbour town woke before the sun. Fishermen walked down the stone steps with coils of rope on
their shoulders, and the baker opened his shutters to let the smell of bread into the street. On
the headland above them stood the lighthouse, a white tower that had guided ships past the rocks
for more than two hundred years. Its keeper, an old woman named Margaret, climbed the spiral stairs
every evening to light the lamp and every morning to put it out.

Nobody remembered exactly when the first light was built. The parish records spoke of a fire kept
burning in an iron basket on the cliff, fed with coal carried up by donkeys. Sailors complained
that the smoke hid the flame in bad weather, and that on the nights they most needed it the rain
put it out altogether. After a merchant ship broke apart on the reef one winter, with the loss of
every hand aboard, the town council raised money for a proper tower with a glass lantern on top.

The engineers who designed it had to solve problems that seem simple today. How do you make a small
flame visible twenty miles away? How do you stop a tall stone tower from cracking when the wind
pushes against it for weeks without rest? How do you tell one lighthouse from another along a coast
that has many of them? The answers came slowly, through experiment and failure. Curved mirrors
behind the lamp gathered light that would otherwise have been lost. Later, rings of glass prisms
bent the light into a narrow beam, so that a single lamp could be seen far out at sea. Each tower
was given its own pattern of flashes, one long and two short, or three quick flashes every ten
seconds, and these patterns were printed in books that every captain carried.

Margaret learned the work from her father. He taught her to trim the wick so that it burned without
smoke, to polish the brass until it shone, and to wind the clockwork that turned the lens. The
clockwork was the heart of the station. A heavy weight hung on a chain down the centre of the tower,
and as it fell it drove the gears that rotated the lens at a steady pace. If the weight reached the
bottom, the light stopped turning, and a ship that expected three flashes would see a steady glow
and might mistake the coast for another. So every few hours through the night the keeper climbed
up again and wound the weight back to the top.

In the long hours between windings she kept a logbook. She wrote down the weather, the direction
of the wind, the ships that passed and the times they passed. She noted when the oil was delivered
and how much was burned. Inspectors came twice a year to read the book, to check that the glass was
clean, and to count the spare wicks in the store room. They were strict men who rarely smiled, but
they respected keepers who did the work well, and they always left Margaret's station satisfied.

The town changed around her. The railway arrived and brought visitors from the city, who walked
along the cliffs in fine clothes and asked to see the lamp. A school was built, and then a small
hospital. The fishing boats got engines, and the harbour was dredged so that larger ships could
come in to unload timber and grain. Each change brought more traffic past the headland, and the
light mattered more than ever, even as the people who depended on it thought about it less.

One autumn a storm blew for three days without pause. Waves broke over the lower windows of the
tower, and spray reached the lantern itself. On the second night the chain that held the weight
snapped, and the heavy iron fell to the bottom of the shaft with a noise like a cannon. Margaret
could not repair it in the dark. Instead she turned the lens by hand, walking it around in a circle
and counting the seconds so that the flashes kept their pattern. She did this for eleven hours,
until the light of morning made the lamp unnecessary, and then she slept on the floor of the
lantern room until a boat could reach her with a new chain.

Years later electricity came to the headland. Engineers installed a bright lamp that needed no
wick, and an electric motor that turned the lens without any weight or chain. A radio beacon was
added, so that ships could find the coast even in fog too thick for any light to pierce. Finally a
letter arrived from the authority in the capital: the station would become automatic, and the
keeper's post would end at the close of the year. Margaret was given a pension and a small medal.

She did not leave the town. She took a cottage near the harbour, from whose window she could see
the tower. Children from the school came to visit her and asked about the storms, the inspectors,
and the night she turned the light by hand. She told them that the most important part of the job
had never been bravery. It had been patience: doing the same careful things every day, in the same
order, whether anyone was watching or not, because somewhere out in the dark a ship was counting on
the light to be exactly where the chart said it would be.

The lighthouse still stands. Its lamp is smaller now, and a computer in a distant office checks
that it is working. Most ships navigate by satellite and rarely look at the coast at all. But on
clear nights the beam still sweeps across the water, three quick flashes every ten seconds, just as
it did when Margaret climbed the stairs. People in the town say that when the light passes over the
harbour they sometimes think of her, and of all the keepers before her, who kept the flame alive.
"""
