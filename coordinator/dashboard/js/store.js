// The dashboard's shared state and a tiny event bus between its modules.

export const state = {
  route: { view: "run", run: null, tab: "overview", volunteer: null },
  runs: [],
  runsLoaded: false,
  selected: null, // the run shown (its name)
  run: null, // the selected run as the API last described it
  leaderboard: null,
  unknown: false, // the selected run does not exist
  lastUpdate: 0, // ms, when the live feed last said something
  apiDown: false,
  overall: null,
};

const bus = new EventTarget();

/** Events: "auth" (signed in or out), "run" (the selected run changed or updated), "runs" (the list),
 * "point" (a new history point for the selected run), "connection". */
export function emit(name, detail) {
  bus.dispatchEvent(new CustomEvent(name, { detail }));
}

export function on(name, handler) {
  bus.addEventListener(name, (event) => handler(event.detail));
}
