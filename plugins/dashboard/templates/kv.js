// The KV page's refresh: polls /kv/api.json?html=1 and swaps in the sections that changed;
// keeps the state rows the user opened or closed. Inlined by kv.html.
(function(){
  var api = document.body.getAttribute('data-api');
  var every = parseInt(document.body.getAttribute('data-refresh'), 10);  // ms (daskflow-kv.dashboard.refresh)
  var focus = new URLSearchParams(location.search).get('state');
  var dot = document.getElementById('live'), stamp = document.getElementById('stamp');
  var toggled = {};  // state id -> blocks shown, as the user left them (kept across refreshes)
  function show(id, on){
    var row = document.getElementById('b-' + id), btn = document.querySelector('button.tog[data-state="' + id + '"]');
    if (!row || !btn) return;
    row.hidden = !on; btn.textContent = on ? '▾' : '▸'; btn.setAttribute('aria-expanded', on ? 'true' : 'false');
  }
  document.addEventListener('click', function(ev){
    var btn = ev.target.closest ? ev.target.closest('button.tog') : null;
    if (!btn) return;
    var id = btn.getAttribute('data-state');
    toggled[id] = btn.getAttribute('aria-expanded') !== 'true';
    show(id, toggled[id]);
  });
  // The live plots (plots.py): embedded once, then each poll replaces their sources' columns.
  var item = document.getElementById('kv-plots-item');
  if (item && window.Bokeh) Bokeh.embed.embed_item(JSON.parse(item.textContent), 'kv-plots');
  function nans(v){ return Array.isArray(v) ? v.map(nans) : (v === null ? NaN : v); }
  function plot(columns){
    if (!window.Bokeh || !columns) return;
    Bokeh.documents.forEach(function(doc){
      Object.keys(columns).forEach(function(name){
        var source = doc.get_model_by_name(name);
        if (!source) return;
        var data = {};
        Object.keys(columns[name]).forEach(function(k){ data[k] = nans(columns[name][k]); });
        source.data = data;
      });
    });
  }
  function tick(){
    var url = api + '?html=1' + (focus ? '&state=' + encodeURIComponent(focus) : '');
    fetch(url, {cache: 'no-store'}).then(function(r){ return r.json(); }).then(function(d){
      Object.keys(d.html || {}).forEach(function(k){
        var el = document.getElementById('kv-' + k);
        if (el && el.getAttribute('data-html') !== d.html[k]) { el.innerHTML = d.html[k]; el.setAttribute('data-html', d.html[k]); }
      });
      Object.keys(toggled).forEach(function(id){ show(id, toggled[id]); });
      plot(d.plots);
      dot.className = 'live'; stamp.textContent = new Date(d.time * 1000).toLocaleTimeString();
    }).catch(function(){ dot.className = 'live stale'; });
  }
  setInterval(tick, every);
})();
