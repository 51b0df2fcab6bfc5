// Entry point: wires the WebSocket, the chat controller, the dashboard, the view tabs, the
// connection indicator and the API-key dialog. The indicator mirrors ChatSocket's state exactly
// (connected only while the socket is open) and counts down to the next reconnect attempt.

import { getApiKey, onAuthRequired, setApiKey } from "./js/api.js";
import { ChatController } from "./js/chat.js";
import { Dashboard } from "./js/dashboard.js";
import { ChatSocket } from "./js/socket.js";
import { decorate } from "./js/icons.js";
import { toast } from "./js/ui.js";

const connEl = document.getElementById("conn");
const connText = document.getElementById("conn-text");
const reconnectBtn = document.getElementById("reconnect-btn");
const authDialog = document.getElementById("auth-dialog");
let countdown = 0;
let wasOpen = false;
let authDismissed = false; // after Escape, stop re-opening the dialog on every failed poll

function wsUrl() {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const key = getApiKey();
  return `${proto}//${location.host}/v1/chat/ws${key ? `?api_key=${encodeURIComponent(key)}` : ""}`;
}

function showState(state) {
  clearInterval(countdown);
  connEl.dataset.state = state.name;
  reconnectBtn.hidden = !(state.name === "reconnecting" || state.name === "auth");
  reconnectBtn.textContent = state.name === "auth" ? "Enter API key" : "Reconnect now";
  if (state.name === "open") {
    connText.textContent = "Connected";
    if (wasOpen) chat.onReconnected();
    wasOpen = true;
  } else if (state.name === "connecting") {
    connText.textContent = "Connecting…";
  } else if (state.name === "auth") {
    connText.textContent = "API key needed";
  } else if (state.name === "reconnecting") {
    const tick = () => {
      const left = state.retryAt ? Math.max(0, Math.ceil((state.retryAt - Date.now()) / 1000)) : 0;
      connText.textContent = left > 0 ? `Disconnected · retrying in ${left} s` : `Reconnecting (attempt ${state.attempt})…`;
    };
    tick();
    countdown = setInterval(tick, 1000);
  }
}

function askForKey(reason, { force = false } = {}) {
  if (authDismissed && !force) return;
  authDismissed = false;
  // With a key stored, any auth failure means that key is wrong, whichever request noticed first.
  const lead = getApiKey() ? "The API key was rejected." : reason;
  document.getElementById("auth-reason").textContent =
    `${lead ? `${lead} ` : ""}This server was started with --api-key; enter the key to continue.`;
  if (!authDialog.open) authDialog.showModal();
  document.getElementById("auth-key").focus();
}

const socket = new ChatSocket({
  url: wsUrl,
  onFrame: (f) => chat.turns.handleFrame(f),
  onState: showState,
  onBadFrame: (msg) => toast(msg),
  onAuthRequired: askForKey,
});
const chat = new ChatController(socket);
const dashboard = new Dashboard();

onAuthRequired((reason) => askForKey(reason));
authDialog.addEventListener("cancel", () => {
  authDismissed = true;
  reconnectBtn.hidden = false;
  reconnectBtn.textContent = "Enter API key";
});
document.getElementById("auth-form").addEventListener("submit", () => {
  setApiKey(document.getElementById("auth-key").value.trim());
  socket.reconnectNow();
  chat.refreshList();
});
reconnectBtn.addEventListener("click", () => (socket.state.name === "auth" || authDismissed ? askForKey("", { force: true }) : socket.reconnectNow()));

// Tabs: arrow keys move between them (WAI-ARIA tabs pattern), activation follows focus.
const tabs = [document.getElementById("tab-chat"), document.getElementById("tab-dashboard")];
function selectTab(tab) {
  for (const t of tabs) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    document.getElementById(t.getAttribute("aria-controls")).hidden = !on;
  }
  dashboard.setVisible(tab.id === "tab-dashboard");
  history.replaceState(null, "", tab.id === "tab-dashboard" ? "#dashboard" : "#chat");
}
tabs.forEach((tab, i) => {
  tab.addEventListener("click", () => selectTab(tab));
  tab.addEventListener("keydown", (ev) => {
    const dir = ev.key === "ArrowRight" ? 1 : ev.key === "ArrowLeft" ? -1 : 0;
    if (!dir) return;
    const next = tabs[(i + dir + tabs.length) % tabs.length];
    next.focus();
    selectTab(next);
  });
});

decorate();
selectTab(location.hash === "#dashboard" ? tabs[1] : tabs[0]);
socket.connect();
chat.start();
dashboard.start();
