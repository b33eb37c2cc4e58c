// coli serve's page: a chat through /v1/chat/completions (streamed), and the model's
// experts at work from GET /routing. Plain JavaScript, no build step, nothing fetched
// from elsewhere.
'use strict';

const $ = (id) => document.getElementById(id);

const KEY_STORE = 'coli.apiKey';
const page = {
  key: localStorage.getItem(KEY_STORE) || '',
  // The conversation sent with each request: {role, content}.
  messages: [],
  // The request being answered, to stop it.
  answering: null,
  routing: null,
};

function headers(json) {
  const h = {};
  if (json) h['Content-Type'] = 'application/json';
  if (page.key) h.Authorization = 'Bearer ' + page.key;
  return h;
}

function say(text) {
  $('status').textContent = text;
}

// The server wants its API key: ask for it.
function needKey() {
  $('key-form').hidden = false;
  say(page.key ? 'the API key was refused: type the right one' : 'this server needs its API key');
  $('key').focus();
}

// An error answer's message (OpenAI's shape), as an Error.
async function failure(response) {
  let message = 'HTTP ' + response.status;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message += ': ' + body.error.message;
  } catch (_) {
    // Not JSON: the status says enough.
  }
  if (response.status === 401) needKey();
  return new Error(message);
}

// Server-sent events from a fetch response: yields {event, data} per event.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, '\n');
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = 'message';
      const data = [];
      for (const line of block.split('\n')) {
        if (line === '' || line.startsWith(':')) continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? '' : line.slice(colon + 1);
        if (value.startsWith(' ')) value = value.slice(1);
        if (field === 'event') event = value;
        else if (field === 'data') data.push(value);
      }
      if (data.length) yield { event, data: data.join('\n') };
    }
  }
}

// ---- the chat ----

function bubble(role, text) {
  const div = document.createElement('div');
  div.className = 'message ' + role;
  const label = document.createElement('div');
  label.className = 'role';
  label.textContent = role;
  const reasoning = document.createElement('div');
  reasoning.className = 'reasoning';
  const body = document.createElement('div');
  body.className = 'text';
  body.textContent = text;
  const meta = document.createElement('div');
  meta.className = 'meta';
  div.append(label, reasoning, body, meta);
  $('messages').append(div);
  div.scrollIntoView({ block: 'end' });
  return div;
}

function busy(answering) {
  $('send').disabled = answering;
  $('stop').disabled = !answering;
  $('regenerate').disabled = answering || !page.messages.some((m) => m.role === 'user');
}

function request() {
  const messages = [];
  const system = $('system').value.trim();
  if (system) messages.push({ role: 'system', content: system });
  messages.push(...page.messages);
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  const max = parseInt($('max-tokens').value, 10);
  if (max > 0) body.max_tokens = max;
  const temperature = $('temperature').value.trim();
  if (temperature !== '') body.temperature = Number(temperature);
  return body;
}

// Ask for the answer to the conversation so far, streaming it into a new bubble.
async function answer() {
  const div = bubble('assistant', '');
  div.classList.add('streaming');
  const text = div.querySelector('.text');
  const reasoning = div.querySelector('.reasoning');
  const meta = div.querySelector('.meta');
  const controller = new AbortController();
  page.answering = controller;
  busy(true);
  let content = '';
  let thought = '';
  let finish = null;
  let usage = null;
  // The text is written once a frame, however many pieces came in it.
  let shown = true;
  const show = () => {
    shown = true;
    reasoning.textContent = thought;
    text.textContent = content;
    div.scrollIntoView({ block: 'end' });
  };
  try {
    const response = await fetch('/v1/chat/completions', {
      method: 'POST',
      headers: headers(true),
      body: JSON.stringify(request()),
      signal: controller.signal,
    });
    if (!response.ok) throw await failure(response);
    say('');
    for await (const { data } of events(response)) {
      if (data === '[DONE]') break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        thought += delta.reasoning_content || '';
        content += delta.content || '';
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
      if (shown) {
        shown = false;
        requestAnimationFrame(show);
      }
    }
    const parts = [finish || 'ended'];
    if (usage) {
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push(`${usage.completion_tokens} tokens`, `prompt ${usage.prompt_tokens} (${cached} cached)`);
    }
    meta.textContent = parts.join(' · ');
  } catch (err) {
    if (err.name === 'AbortError') {
      meta.textContent = 'stopped';
    } else {
      div.classList.add('error');
      meta.textContent = String(err.message || err);
    }
  } finally {
    show();
    div.classList.remove('streaming');
    if (content) page.messages.push({ role: 'assistant', content });
    div.dataset.done = finish || 'stopped';
    page.answering = null;
    busy(false);
  }
}

function send(event) {
  event.preventDefault();
  const input = $('input');
  const content = input.value.trim();
  if (!content || page.answering) return;
  input.value = '';
  page.messages.push({ role: 'user', content });
  bubble('user', content);
  answer();
}

// Ask the last user message again: the answers after it go.
function regenerate() {
  if (page.answering) return;
  const last = page.messages.map((m) => m.role).lastIndexOf('user');
  if (last < 0) return;
  page.messages.length = last + 1;
  const bubbles = [...$('messages').querySelectorAll('.message')];
  const lastUser = bubbles.map((b) => b.classList.contains('user')).lastIndexOf(true);
  bubbles.slice(lastUser + 1).forEach((b) => b.remove());
  answer();
}

function newChat() {
  if (page.answering) page.answering.abort();
  page.messages = [];
  $('messages').replaceChildren();
  busy(false);
}

// ---- the routing view ----

const COLOURS = {
  none: [138, 143, 152],
  slot: [63, 185, 80],
  pin: [88, 166, 255],
  vram: [210, 168, 255],
};
// How long a routed cell glows after its step, in ms.
const GLOW_MS = 700;

const grid = {
  canvas: null,
  layers: [], // the rows drawn: the layers that route
  experts: 0,
  width: 0, // experts per row of the tables
  kinds: [],
  heat: [],
  residence: [],
  routedAt: [], // per cell: when it was last routed (performance.now())
  last: new Set(), // cells the last step routed: layer * width + expert
  maxHeat: 0,
  cell: 8,
  gap: 1,
  margin: 30,
  events: 0,
  drawing: false,

  shape(data) {
    this.layers = data.moe_layers;
    this.experts = data.experts;
    this.width = data.experts;
    this.kinds = data.residence_kinds;
    this.heat = data.heat.flat();
    this.residence = data.residence.flat();
    this.routedAt = new Array(this.heat.length).fill(-Infinity);
    this.last = new Set();
    this.maxHeat = this.heat.reduce((a, b) => Math.max(a, b), 0);
    $('model').textContent = `${data.model} (${data.engine})`;
    $('shape').textContent = `${this.layers.length} MoE layers × ${this.experts} experts`;
    const c = this.canvas;
    c.dataset.layers = data.layers;
    c.dataset.experts = data.experts;
    c.dataset.moeLayers = this.layers.join(' ');
    this.stats(data.counters);
    this.resize();
  },

  step(data) {
    const now = performance.now();
    for (const [layer, expert, heat] of data.heat) {
      this.heat[layer * this.width + expert] = heat;
      if (heat > this.maxHeat) this.maxHeat = heat;
    }
    for (const [layer, expert, kind] of data.residence) {
      this.residence[layer * this.width + expert] = kind;
    }
    this.last = new Set();
    const named = [];
    for (const [layer, experts] of data.routed) {
      for (const expert of experts) {
        const i = layer * this.width + expert;
        this.last.add(i);
        this.routedAt[i] = now;
        named.push(`${layer}:${expert}`);
      }
    }
    this.events += 1;
    const c = this.canvas;
    c.dataset.events = this.events;
    c.dataset.lastRouted = named.join(' ');
    $('stat-events').textContent = this.events;
    this.stats(data.counters);
    this.draw();
  },

  stats(counters) {
    const rates = counters.rates || {};
    const hit = rates.hit_rate != null ? rates.hit_rate : counters.hit_rate;
    $('stat-hit').textContent = hit != null ? hit.toFixed(1) + ' %' : '–';
    $('stat-disk').textContent = rates.disk_mb_per_token != null ? rates.disk_mb_per_token.toFixed(2) : '–';
    $('stat-rate').textContent = rates.tokens_per_second != null ? rates.tokens_per_second.toFixed(1) : '–';
    $('stat-tokens').textContent = counters.tokens;
  },

  resize() {
    if (!this.experts) return;
    const room = $('grid-wrap').clientWidth - this.margin;
    this.cell = Math.max(2, Math.min(20, Math.floor(room / this.experts)));
    this.gap = this.cell >= 6 ? 1 : 0;
    const c = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const w = this.margin + this.experts * this.cell;
    const h = this.layers.length * this.cell + 14;
    c.style.width = w + 'px';
    c.style.height = h + 'px';
    c.width = Math.round(w * ratio);
    c.height = Math.round(h * ratio);
    c.getContext('2d').setTransform(ratio, 0, 0, ratio, 0, 0);
    this.draw();
  },

  colour(i, now) {
    const base = COLOURS[this.kinds[this.residence[i]]] || COLOURS.none;
    const heat = this.heat[i];
    const level = this.maxHeat > 0 ? Math.log1p(heat) / Math.log1p(this.maxHeat) : 0;
    const bright = 0.16 + 0.84 * level;
    const glow = Math.max(0, 1 - (now - this.routedAt[i]) / GLOW_MS);
    const mix = (v) => Math.round(v * bright * (1 - glow) + 255 * glow);
    return `rgb(${mix(base[0])},${mix(base[1])},${mix(base[2])})`;
  },

  draw() {
    if (this.drawing) return;
    this.drawing = true;
    requestAnimationFrame(() => {
      this.drawing = false;
      this.paint();
    });
  },

  paint() {
    const c = this.canvas;
    const g = c.getContext('2d');
    const now = performance.now();
    const size = this.cell - this.gap;
    g.clearRect(0, 0, c.width, c.height);
    g.fillStyle = '#9aa3b2';
    g.font = '10px ui-monospace, monospace';
    g.textBaseline = 'middle';
    const labelEvery = Math.max(1, Math.ceil(11 / this.cell));
    let glowing = false;
    this.layers.forEach((layer, row) => {
      const y = row * this.cell;
      if (row % labelEvery === 0) {
        g.fillStyle = '#9aa3b2';
        g.fillText(String(layer), 0, y + this.cell / 2);
      }
      for (let e = 0; e < this.experts; e += 1) {
        const i = layer * this.width + e;
        g.fillStyle = this.colour(i, now);
        g.fillRect(this.margin + e * this.cell, y, size, size);
        if (now - this.routedAt[i] < GLOW_MS) glowing = true;
      }
    });
    // The last step's experts keep an outline until the next step.
    g.strokeStyle = '#ffffff';
    g.lineWidth = 1;
    for (const i of this.last) {
      const row = this.layers.indexOf(Math.floor(i / this.width));
      if (row < 0) continue;
      const e = i % this.width;
      g.strokeRect(this.margin + e * this.cell + 0.5, row * this.cell + 0.5, Math.max(1, size - 1), Math.max(1, size - 1));
    }
    g.fillStyle = '#9aa3b2';
    g.fillText('experts →', this.margin, this.layers.length * this.cell + 7);
    if (glowing) this.draw();
  },

  // The cell under the pointer, described.
  point(event) {
    const rect = this.canvas.getBoundingClientRect();
    const e = Math.floor((event.clientX - rect.left - this.margin) / this.cell);
    const row = Math.floor((event.clientY - rect.top) / this.cell);
    const layer = this.layers[row];
    if (layer === undefined || e < 0 || e >= this.experts) {
      $('tip').textContent = '\u00a0';
      return;
    }
    const i = layer * this.width + e;
    $('tip').textContent = `layer ${layer} · expert ${e} · ${this.kinds[this.residence[i]]} · ${this.heat[i]} selections`;
  },
};

// Follow GET /routing, again after a pause when it breaks.
async function watchRouting() {
  if (page.routing) page.routing.abort();
  const controller = new AbortController();
  page.routing = controller;
  try {
    const response = await fetch('/routing', { headers: headers(false), signal: controller.signal, cache: 'no-store' });
    if (!response.ok) {
      const err = await failure(response);
      if (response.status === 401) return;
      throw err;
    }
    for await (const { event, data } of events(response)) {
      if (event === 'shape') grid.shape(JSON.parse(data));
      else if (event === 'step') grid.step(JSON.parse(data));
    }
    say('the routing stream ended; reconnecting');
  } catch (err) {
    if (err.name === 'AbortError') return;
    say('routing: ' + (err.message || err) + '; reconnecting');
  }
  if (page.routing === controller) setTimeout(watchRouting, 2000);
}

function useKey(event) {
  event.preventDefault();
  page.key = $('key').value.trim();
  if (page.key) localStorage.setItem(KEY_STORE, page.key);
  else localStorage.removeItem(KEY_STORE);
  say('');
  watchRouting();
}

window.addEventListener('DOMContentLoaded', () => {
  grid.canvas = $('grid');
  $('key').value = page.key;
  $('key-form').hidden = !page.key;
  $('key-form').addEventListener('submit', useKey);
  $('ask').addEventListener('submit', send);
  $('input').addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey) send(event);
  });
  $('stop').addEventListener('click', () => page.answering && page.answering.abort());
  $('regenerate').addEventListener('click', regenerate);
  $('new-chat').addEventListener('click', newChat);
  grid.canvas.addEventListener('mousemove', (event) => grid.point(event));
  window.addEventListener('resize', () => grid.resize());
  busy(false);
  watchRouting();
});
