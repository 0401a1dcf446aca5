// fw's chat page: plain JavaScript, no build step, nothing from outside this server.
// It talks to fw's public API only (/v1/models, /v1/fw/samplers, /v1/chat/completions, /version)
// and sends the API key the user typed (kept in sessionStorage) when the server asks for one.
// Model output is always written with textContent, never parsed as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "fw.apiKey";
  const state = { messages: [], views: [], controller: null, samplers: [], conversation: 0 };

  // -- the API ------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message, param) {
      super(message);
      this.status = status;
      this.param = param || null;
    }
  }

  const apiKey = () => sessionStorage.getItem(KEY_STORE) || "";

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = apiKey();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorFrom(response) {
    let message = `HTTP ${response.status} ${response.statusText}`.trim();
    let param = null;
    try {
      const body = await response.json();
      if (body && body.error) {
        message = body.error.message || message;
        param = body.error.param;
      }
    } catch (_) { /* not JSON: keep the status line */ }
    return new ApiError(response.status, message, param);
  }

  async function getJSON(path) {
    const response = await fetch(path, { headers: headers(false) });
    if (!response.ok) throw await errorFrom(response);
    return response.json();
  }

  // Server-sent events from a fetch body: yields each event's data (`[DONE]` included).
  async function* sseData(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = event.split("\n").filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (data) yield data;
        }
      }
    } finally {
      reader.releaseLock();
    }
  }

  // -- the API key --------------------------------------------------------------------------

  function askForKey(reason) {
    $("key-panel").hidden = false;
    $("key-reason").textContent = reason;
    $("key-input").value = "";
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    $("key-input").value = "";
    $("key-panel").hidden = true;
    loadServer();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    askForKey("The key is forgotten. Type one to use this server again.");
  });
  $("key-button").addEventListener("click", () => {
    if ($("key-panel").hidden) askForKey("Type the server's API key (fw serve --api-key). It is kept in this " +
      "tab's session storage only.");
    else $("key-panel").hidden = true;
  });

  function handleAuth(error) {
    if (error instanceof ApiError && error.status === 401) {
      askForKey(apiKey() ? "The server refused this key: " + error.message
        : "This server needs an API key (fw serve --api-key). It is kept in this tab's session storage " +
          "and sent as Authorization: Bearer on each API call.");
      return true;
    }
    return false;
  }

  // -- models, version, sampler plugins -----------------------------------------------------

  async function loadServer() {
    const status = $("server-status");
    try {
      const version = await getJSON("/version");
      status.textContent = `fw ${version.version}`;
    } catch (_) {
      status.textContent = "";
    }
    try {
      const models = await getJSON("/v1/models");
      const select = $("model");
      const previous = select.value;
      select.replaceChildren();
      for (const model of models.data) {
        const option = document.createElement("option");
        option.value = model.id;
        option.textContent = model.max_model_len ? `${model.id} (${model.max_model_len} tokens)` : model.id;
        select.append(option);
      }
      if (previous && models.data.some((m) => m.id === previous)) select.value = previous;
      const samplers = await getJSON("/v1/fw/samplers");
      renderSamplers(samplers.data.filter((s) => s.per_request));
      document.body.dataset.ready = "true";
    } catch (error) {
      if (!handleAuth(error)) status.textContent = "cannot reach the server: " + error.message;
    }
  }

  // A control for one parameter of a sampler's JSON schema.
  function parameterControl(name, schema) {
    const label = document.createElement("label");
    label.append(name + " ");
    let input;
    const kind = Array.isArray(schema.type) ? schema.type[0] : schema.type;
    if (Array.isArray(schema.enum)) {
      input = document.createElement("select");
      for (const value of schema.enum) {
        const option = document.createElement("option");
        option.value = JSON.stringify(value);
        option.textContent = String(value);
        input.append(option);
      }
      if ("default" in schema) input.value = JSON.stringify(schema.default);
      input.dataset.kind = "json";
    } else if (kind === "boolean") {
      input = document.createElement("input");
      input.type = "checkbox";
      input.checked = Boolean(schema.default);
      input.dataset.kind = "boolean";
      label.classList.add("inline");
    } else if (kind === "number" || kind === "integer") {
      input = document.createElement("input");
      input.type = "number";
      input.step = kind === "integer" ? "1" : "any";
      if (schema.minimum !== undefined) input.min = schema.minimum;
      if (schema.maximum !== undefined) input.max = schema.maximum;
      if (schema.default !== undefined) input.value = schema.default;
      input.dataset.kind = "number";
    } else if (kind === "string") {
      input = document.createElement("input");
      input.type = "text";
      if (schema.default !== undefined) input.value = schema.default;
      input.dataset.kind = "string";
    } else {  // arrays, objects, unions: a JSON box, checked as typed against the declared JSON type
      return jsonBox(label, name, schema, kind);
    }
    input.dataset.param = name;
    if (schema.description) label.title = schema.description;
    label.append(input);
    return label;
  }

  // What a JSON box must hold, in words ("a JSON array of strings"), from the parameter's schema.
  function jsonTypeWords(schema, kind) {
    if (kind === "array") {
      const items = schema.items && schema.items.type;
      return "a JSON array" + (items ? ` of ${items}s` : "");
    }
    return kind === "object" ? "a JSON object" : "JSON";
  }

  // A parameter whose schema nests (an array, an object, or no single type): a multi-line box holding
  // JSON, with its schema as the tooltip and a line that says at each change whether it parses as the
  // declared type (the server checks the rest against the whole schema).
  function jsonBox(label, name, schema, kind) {
    label.classList.add("json-param");
    const input = document.createElement("textarea");
    input.spellcheck = false;
    input.rows = kind === "object" ? 4 : 2;
    if (schema.default !== undefined) {
      input.value = JSON.stringify(schema.default, null, kind === "object" ? 1 : 0);
    }
    input.placeholder = jsonTypeWords(schema, kind);
    input.dataset.kind = "json";
    if (kind === "array" || kind === "object") input.dataset.jsonType = kind;
    input.dataset.param = name;
    label.title = (schema.description ? schema.description + "\n" : "") + "schema: " + JSON.stringify(schema);
    const status = document.createElement("span");
    status.className = "json-status muted";
    const check = () => {
      try {
        if (input.value.trim() !== "") parseJsonParam(input, name);
        status.textContent = input.value.trim() === "" ? "" : "JSON: ok";
        status.classList.remove("bad");
      } catch (error) {
        status.textContent = error.message;
        status.classList.add("bad");
      }
    };
    input.addEventListener("input", check);
    label.append(input, status);
    return label;
  }

  // A JSON box's value, or an error naming the parameter and what it must hold.
  function parseJsonParam(input, name, sampler) {
    const where = sampler ? `${sampler}.${name}` : name;
    let value;
    try {
      value = JSON.parse(input.value);
    } catch (error) {
      throw new Error(`${where} is not JSON: ${error.message}`);
    }
    const want = input.dataset.jsonType;
    const isObject = value !== null && typeof value === "object" && !Array.isArray(value);
    if ((want === "array" && !Array.isArray(value)) || (want === "object" && !isObject)) {
      throw new Error(`${where} must be ${input.placeholder}, got ${JSON.stringify(value)}`);
    }
    return value;
  }

  function renderSamplers(samplers) {
    const box = $("samplers");
    box.replaceChildren();
    state.samplers = [];
    if (!samplers.length) {
      const none = document.createElement("p");
      none.className = "muted";
      none.textContent = "This server has no per-request sampler plugins.";
      box.append(none);
      return;
    }
    for (const sampler of samplers) {
      const fieldset = document.createElement("fieldset");
      fieldset.className = "sampler";
      fieldset.dataset.sampler = sampler.name;
      fieldset.disabled = true;
      const legend = document.createElement("legend");
      const toggle = document.createElement("input");
      toggle.type = "checkbox";
      toggle.dataset.role = "use";
      toggle.addEventListener("change", () => { fieldset.disabled = !toggle.checked; });
      const legendLabel = document.createElement("label");
      legendLabel.className = "inline";
      legendLabel.append(toggle, sampler.name);
      legend.append(legendLabel);
      fieldset.append(legend);
      if (sampler.description) {
        const description = document.createElement("p");
        description.className = "description muted";
        description.textContent = sampler.description;
        fieldset.append(description);
      }
      const properties = (sampler.parameters && sampler.parameters.properties) || {};
      const inputs = [];
      for (const [name, schema] of Object.entries(properties)) {
        const control = parameterControl(name, schema || {});
        inputs.push(control.querySelector("[data-param]"));
        fieldset.append(control);
      }
      box.append(fieldset);
      state.samplers.push({ name: sampler.name, toggle, inputs });
    }
  }

  // -- the request --------------------------------------------------------------------------

  function numberField(id) {
    const text = $(id).value.trim();
    return text === "" ? undefined : Number(text);
  }

  function samplersField() {
    const out = [];
    for (const sampler of state.samplers) {
      if (!sampler.toggle.checked) continue;
      const entry = { name: sampler.name };
      for (const input of sampler.inputs) {
        const name = input.dataset.param;
        const kind = input.dataset.kind;
        if (kind === "boolean") { entry[name] = input.checked; continue; }
        const text = input.value.trim();
        if (text === "") continue;
        if (kind === "number") entry[name] = Number(text);
        else if (kind === "string") entry[name] = input.value;
        else entry[name] = parseJsonParam(input, name, sampler.name);
      }
      out.push(entry);
    }
    return out;
  }

  function schemaField() {
    const text = $("schema").value;
    try {
      return JSON.parse(text);
    } catch (error) {
      throw new Error("the JSON schema box does not hold JSON: " + error.message);
    }
  }

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.messages);
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if ($("model").value) body.model = $("model").value;
    for (const [field, id] of [["temperature", "temperature"], ["top_p", "top_p"], ["max_tokens", "max_tokens"],
      ["seed", "seed"]]) {
      const value = numberField(id);
      if (value !== undefined) body[field] = value;
    }
    const samplers = samplersField();
    if (samplers.length) body.samplers = samplers;
    if ($("schema-on").checked) {
      body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: schemaField(), strict: true } };
    }
    return body;
  }

  $("schema").addEventListener("input", checkSchemaBox);
  $("schema-on").addEventListener("change", checkSchemaBox);

  function checkSchemaBox() {
    const status = $("schema-status");
    try {
      const schema = schemaField();
      status.textContent = typeof schema === "object" && schema !== null ? "JSON: ok" : "a schema is a JSON object";
      status.classList.toggle("bad", typeof schema !== "object" || schema === null);
    } catch (error) {
      status.textContent = error.message;
      status.classList.add("bad");
    }
  }

  // -- the conversation ---------------------------------------------------------------------

  function addView(role, text) {
    const element = document.createElement("div");
    element.className = "message " + role;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role === "error" ? "error" : role;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    const stats = document.createElement("div");
    stats.className = "stats";
    element.append(who, content, stats);
    $("messages").append(element);
    element.scrollIntoView({ block: "end" });
    return { element, content, stats };
  }

  function showError(message) {
    const view = addView("error", message);
    view.element.setAttribute("role", "alert");
    return view;
  }

  function clearErrors() {
    for (const element of $("messages").querySelectorAll(".message.error")) element.remove();
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("regenerate").disabled = busy || !state.messages.some((m) => m.role === "user");
    document.body.dataset.busy = busy ? "true" : "false";
  }

  function describeStats(stats) {
    const parts = [];
    if (stats.ttftMs !== null) parts.push(`TTFT ${stats.ttftMs.toFixed(0)} ms`);
    if (stats.tokS !== null) parts.push(`${stats.tokS.toFixed(1)} tok/s`);
    parts.push(`${stats.tokens} tokens`);
    if (stats.finish) parts.push(stats.finish);
    if (stats.json !== null) parts.push(stats.json ? "valid JSON" : "not JSON");
    return parts.join(" · ");
  }

  async function generate() {
    clearErrors();
    let body;
    try {
      body = requestBody();
    } catch (error) {
      showError(error.message);
      return;
    }
    $("last-request").textContent = JSON.stringify(body, null, 2);
    const view = addView("assistant", "");
    view.element.classList.add("streaming");
    const controller = new AbortController();
    const conversation = state.conversation;  // "New chat" while this streams: its reply is dropped
    state.controller = controller;
    setBusy(true);
    const start = performance.now();
    let first = null;
    let last = null;
    let chunks = 0;
    let usage = null;
    let finish = null;
    let text = "";
    let failed = null;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) throw await errorFrom(response);
      for await (const data of sseData(response.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.code, chunk.error.message, chunk.error.param);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            const now = performance.now();
            if (first === null) first = now;
            last = now;
            chunks += 1;
            text += delta;
            view.content.textContent = text;
            view.element.dataset.chunks = String(chunks);
            view.element.scrollIntoView({ block: "end" });
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    } catch (error) {
      if (error.name === "AbortError") finish = "stopped";
      else failed = error;
    } finally {
      state.controller = null;
      view.element.classList.remove("streaming");
    }
    if (conversation !== state.conversation) return;
    if (failed && !text) {
      view.element.remove();
      if (!handleAuth(failed)) showError(failed.message);
    } else {
      if (failed) showError(failed.message);
      state.messages.push({ role: "assistant", content: text });
      state.views.push(view.element);
      const tokens = usage ? usage.completion_tokens : chunks;
      const decodeSeconds = last !== null && first !== null ? (last - first) / 1000 : 0;
      const stats = {
        ttftMs: first === null ? null : first - start,
        tokS: tokens > 1 && decodeSeconds > 0 ? (tokens - 1) / decodeSeconds : null,
        tokens, finish, json: null,
      };
      if (body.response_format) {
        try { JSON.parse(text); stats.json = true; } catch (_) { stats.json = false; }
      }
      view.stats.textContent = describeStats(stats);
      view.element.dataset.tokens = String(tokens);
      if (stats.ttftMs !== null) view.element.dataset.ttftMs = stats.ttftMs.toFixed(1);
      if (stats.tokS !== null) view.element.dataset.tokS = stats.tokS.toFixed(2);
      view.element.dataset.finish = finish || "";
    }
    setBusy(false);
  }

  function send() {
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    $("prompt").value = "";
    state.messages.push({ role: "user", content: text });
    state.views.push(addView("user", text).element);
    generate();
  }

  function regenerate() {
    if (state.controller) return;
    if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") {
      state.messages.pop();
      state.views.pop().remove();
    }
    if (state.messages.length) generate();
  }

  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.conversation += 1;
    state.messages = [];
    state.views = [];
    $("messages").replaceChildren();
    setBusy(false);
  });

  setBusy(false);
  checkSchemaBox();
  loadServer();
})();
